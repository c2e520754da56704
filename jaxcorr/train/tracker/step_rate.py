"""Seconds per step for the progress line's ETA
(`jaxcorr.train.tracker.metrics.ProgressLine`).

A step that compiles takes 10-30x a step on a CPU: the first RL step (the
update, the engine's programs), but also the second (decode programs for
the batch sizes a trained model's shorter responses leave) and the first
evaluation. Averaged in, they put the ETA of `make run` at 55 minutes
after step 1 and 22 after step 2 for a run that ended 2.5 minutes later.
`StepRate` leaves the first step out and takes from every other step the
time JAX spent compiling during it (`compile_seconds`): what is left is
what the remaining steps will take.
"""

from __future__ import annotations

import math
import threading

from jax import monitoring

# XLA compilation (a persistent-cache read included) and the lowering of a
# traced program, each recorded once per program; tracing is not counted
# (nested jits record it inside their caller's, counting it twice).
COMPILE_EVENTS = (
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
  """Seconds JAX has spent lowering and compiling programs in this process,
  in every thread, since this module was imported (`jax.monitoring`)."""
  with _lock:
    return _compile_s


class StepRate:
  """Seconds per step from step times less their compile time (module
  doc): the first `compile_steps` times are left out, then an exponential
  moving average (weight `smoothing` on the newest), so one slow step (an
  evaluation, a checkpoint) moves it little.

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
    self.value: float | None = None  # seconds per step, None until known

  def add(self, seconds: float, compile_seconds: float = 0.0) -> None:
    """One step's time and the compile time in it (a non-finite step time
    is ignored)."""
    if not math.isfinite(seconds):
      return
    if self._skip > 0:
      self._skip -= 1
      return
    x = max(float(seconds) - max(compile_seconds, 0.0), 0.0)
    ema = self.value
    self.value = x if ema is None else ema + self.smoothing * (x - ema)

  def eta(self, remaining_steps: int) -> float | None:
    """Seconds until `remaining_steps` more steps are done (None: unknown)."""
    if self.value is None:
      return None
    return max(remaining_steps, 0) * self.value
