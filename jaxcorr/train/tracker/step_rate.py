"""Seconds per step for the progress line's ETA
(`jaxcorr.train.tracker.metrics.ProgressLine`).

A step that compiles takes 10-30x a step on a CPU: the first RL step (the
update, the engine's programs), but also the second (decode programs for
the batch sizes a trained model's shorter responses leave: 5.5-6 s of
which ~5 compiling, against 0.5 s for a step). Averaged in, they put the
ETA of `make run` at 55 minutes after step 1 and 22 after step 2 for a run
that ended 2 minutes later. `StepRate` leaves out the first step and every
step that spent more than half its time compiling (`compile_seconds`, the
time JAX spent tracing, lowering and compiling in any thread); what a
compile step leaves besides is no guide either (its programs' first runs:
still twice a step). From the other steps it takes their compile time and
averages the rest: a plain mean over the first 1/smoothing steps, then an
exponential moving average.
"""

from __future__ import annotations

import math
import threading

from jax import monitoring

# Tracing, lowering and XLA compilation (a persistent-cache read included)
# of a program. A jit traced inside another records its tracing inside its
# caller's too: counted twice, which only lowers that step's time (never
# below 0).
COMPILE_EVENTS = (
  '/jax/core/compile/jaxpr_trace_duration',
  '/jax/core/compile/jaxpr_to_mlir_module_duration',
  '/jax/core/compile/backend_compile_duration',
)


_lock = threading.Lock()
_compile_s = 0.0


def _record(event: str, duration: float, **kwargs) -> None:
  global _compile_s
  if event in COMPILE_EVENTS:
    with _lock:
      _compile_s += duration


# One listener for the process, from the first import on.
monitoring.register_event_duration_secs_listener(_record)


def compile_seconds() -> float:
  """Seconds JAX has spent tracing, lowering and compiling programs in this
  process, in every thread, since this module was imported
  (`jax.monitoring`)."""
  with _lock:
    return _compile_s


class StepRate:
  """Seconds per step from step times less their compile time (module
  doc): the first `compile_steps` times and the steps that mostly compiled
  are left out; the rest are averaged, the newest with weight
  max(`smoothing`, 1 / their number), so one slow step (an evaluation, a
  checkpoint) moves the estimate little.

  Args:
    smoothing: the moving average's weight on the newest step time.
    compile_steps: leading step times left out.
  """

  def __init__(self, *, smoothing: float = 0.1, compile_steps: int = 1):
    if not 0 < smoothing <= 1:
      raise ValueError(f'smoothing must be in (0, 1], got {smoothing}')
    if compile_steps < 0:
      raise ValueError(f'compile_steps must be >= 0, got {compile_steps}')
    self.smoothing = smoothing
    self._skip = compile_steps
    self._n = 0  # step times averaged
    self.value: float | None = None  # seconds per step, None until known

  def add(self, seconds: float, compile_seconds: float = 0.0) -> None:
    """One step's time and the compile time in it (a non-finite step time
    is ignored)."""
    if not math.isfinite(seconds):
      return
    if self._skip > 0:
      self._skip -= 1
      return
    compile_seconds = max(compile_seconds, 0.0)
    if compile_seconds > seconds / 2:  # a compile step (module doc)
      return
    x = float(seconds) - compile_seconds
    self._n += 1
    ema = self.value
    w = max(self.smoothing, 1 / self._n)
    self.value = x if ema is None else ema + w * (x - ema)

  def eta(self, remaining_steps: int) -> float | None:
    """Seconds until `remaining_steps` more steps are done (None: unknown)."""
    if self.value is None:
      return None
    return max(remaining_steps, 0) * self.value
