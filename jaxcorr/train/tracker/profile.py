"""`train.profile_steps`: a `jax.profiler` trace of chosen RL steps.

The trace of a run of consecutive chosen steps goes to one directory under
`<workdir>/profile/` (`plugins/profile/<time>/*.xplane.pb` and a
`*.trace.json.gz`): TensorBoard's profile plugin opens the directory
(`tensorboard --logdir <workdir>/profile`), Perfetto (ui.perfetto.dev) the
`.trace.json.gz`. Each step is a `StepTraceAnnotation` ('rl_step', its
number), so the viewers split the trace by step. The trace is stopped only
after the step's device work is done (the step's metrics reach the host
before `stop`), so it holds every kernel of the step.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import jax

from jaxcorr.config.fields import Invalid


def steps_rule(value: Any, path: str) -> str:
  """The `train.profile_steps` rule: '' (off) or a comma list of RL steps
  (1-based, as logged) and ranges `a-b`; stored canonical ('2,3,4')."""
  del path
  allowed = "'' (off) or a comma list of steps >= 1 and ranges, e.g. '3,5-6'"
  if not isinstance(value, str):
    raise Invalid(allowed, 'not a string')
  try:
    steps = parse_steps(value)
  except ValueError as e:
    raise Invalid(allowed, str(e)) from None
  return ','.join(str(s) for s in sorted(steps))


def parse_steps(value: str) -> frozenset[int]:
  """'3,5-6' -> {3, 5, 6}; raises ValueError on anything else."""
  out: set[int] = set()
  for part in filter(None, (p.strip() for p in value.split(','))):
    lo, _, hi = part.partition('-')
    a, b = int(lo), int(hi or lo)
    if a < 1 or b < a:
      raise ValueError(f'bad step range {part!r}')
    out.update(range(a, b + 1))
  return frozenset(out)


class StepProfiler:
  """Traces the chosen steps; `step(n)` wraps RL step n (module doc)."""

  def __init__(self, steps: str, workdir: str):
    self.steps = parse_steps(steps)
    self.logdir = os.path.join(workdir, 'profile')
    self.active = False

  @contextlib.contextmanager
  def step(self, n: int) -> Iterator[None]:
    if n not in self.steps:
      yield
      return
    if not self.active:
      os.makedirs(self.logdir, exist_ok=True)
      jax.profiler.start_trace(self.logdir, create_perfetto_trace=True)
      self.active = True
    try:
      with jax.profiler.StepTraceAnnotation('rl_step', step_num=n):
        yield
    except BaseException:
      self.stop()  # a failed step ends the trace
      raise
    if n + 1 not in self.steps:
      self.stop()

  def stop(self) -> None:
    if self.active:
      jax.profiler.stop_trace()
      self.active = False
