"""Where the trainer's batches come from: one interface, two modes.

    source = make_rollouts(run, stage, loader, weights, start=s0)
    for s in range(s0, num_steps):
      scored = source.next()         # the batch of step s
      ... update ...
      timing = source.publish(s + 1) # the weights after step s
    source.close()

`SyncRollouts` samples each batch on the trainer's thread with the current
weights (staleness 0). `AsyncRollouts` (jaxcorr/train/rollouts/fixed_lag.py)
samples ahead in a producer thread with a fixed lag; `StreamRollouts`
(jaxcorr/train/rollouts/stream.py) decodes continuously and takes new weights
between decode chunks, while sequences are in flight. Either way the source
owns the prompt loader from `start` on, and each `Scored` carries the
loader's state after its draw: what a checkpoint taken after training on it
records. With `dynamic_sampling.enabled` a step's batch may take several
loader batches (jaxcorr/train/rollouts/dynamic_sampling.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from jaxcorr.data.prompts import PromptLoader
from jaxcorr.train.rollouts import dynamic_sampling
from jaxcorr.train.rollouts.fixed_lag import AsyncRollouts
from jaxcorr.train.rollouts.stage import RolloutStage, Scored
from jaxcorr.train.rollouts.stream import StreamRollouts
from jaxcorr.train.run_config import RunConfig
from jaxcorr.train.tracker.reduction import Metric, Metrics


class RolloutSource(Protocol):
  def next(self) -> Scored:
    """The batch of the next step, in step order."""
    ...

  def publish(self, version: int) -> Metrics:
    """The weights of policy version `version` (after step `version - 1`)
    for the batches still to sample; returns its timing metrics."""
    ...

  def lagged(self, step: int) -> dict[int, Any]:
    """`{version: weights}` older than `step` that the source samples later
    batches with: what a checkpoint after step `step` must hold for an
    exact resume (fixed-lag async only; empty for the others)."""
    ...

  def close(self) -> None: ...


class SyncRollouts:
  """Sample on the caller's thread, with the weights of the last update.

  Args:
    stage: generation and scoring (owns the engine).
    loader: the prompt loader.
    weights: () -> the engine's copy of the current weights.
    start: the first step (the engine gets version `start` now).
  """

  def __init__(
    self,
    stage: RolloutStage,
    loader: PromptLoader,
    weights: Callable[[], Any],
    *,
    start: int,
  ):
    self.stage, self.loader, self.weights = stage, loader, weights
    self.step = start
    stage.engine.update_params(weights(), version=start)

  def next(self) -> Scored:
    scored = dynamic_sampling.sample_step(self.stage, self.loader, self.step)
    scored.loader_state = self.loader.state()
    self.step += 1
    return scored

  def publish(self, version: int) -> Metrics:
    t0 = time.perf_counter()
    self.stage.engine.update_params(self.weights(), version=version)
    return {'time/weight_sync': Metric.avg(time.perf_counter() - t0)}

  def lagged(self, step: int) -> dict[int, Any]:
    return {}

  def close(self) -> None:
    pass


def make_rollouts(
  run: RunConfig,
  stage: RolloutStage,
  loader: PromptLoader,
  weights: Callable[[], Any],
  *,
  start: int,
  history: dict[int, Any] | None = None,
) -> RolloutSource:
  """The source `rollout.mode` asks for, producing steps
  `start .. train.num_steps - 1`; `history`: a checkpoint's lagged weights
  (`RolloutSource.lagged`)."""
  r = run.rollout
  if r.mode == 'stream':
    return StreamRollouts(
      run, stage, loader, weights, start=start, num_steps=run.train.num_steps
    )
  if r.mode == 'async':
    return AsyncRollouts(
      stage,
      loader,
      weights,
      start=start,
      num_steps=run.train.num_steps,
      lag=r.max_staleness,
      queue_size=r.queue_size,
      history=history,
    )
  return SyncRollouts(stage, loader, weights, start=start)
