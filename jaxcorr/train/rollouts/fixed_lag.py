"""Async rollout: a producer thread, a bounded queue and a fixed policy lag.

    trainer  step s: get batch s ── prepare/update ── publish version s + 1
    producer batch s: wait for version v(s) ── engine.update_params ──
                      sample + score ── queue.put (blocks when full)

Batch s is sampled with exactly version v(s) = max(s − max_staleness,
first), where `first` is the version the run started from. So staleness is
exactly `max_staleness` once the pipeline is full, never more (the trainer
checks it on every row), and a run is reproducible: which weights sample
which batch does not depend on thread timing. This is verl's
one-step-off-policy pipelining for max_staleness=1 and a fixed-lag version
of fully-async training for larger values.

Resume is exact: a checkpoint after step s holds, besides the weights of
version s, the older versions batches s .. s + max_staleness − 1 are
sampled by (`lagged`, stored by jaxcorr/train/checkpoints/resume.py), and
a producer resumed with them (`history`) samples those batches with the
same weights as the uninterrupted run. Without them (a checkpoint of
another mode or lag) it starts from the resumed version: `first` is then
the resumed step, and the first batches are less stale than in the
uninterrupted run.

The engine may run on its own sub-mesh (`rollout.rollout_devices`): the
producer's `update_params` then copies the published weights across. A
producer exception is re-raised in the trainer by `next`. The producer owns
the prompt loader: the trainer reads each batch's loader state from the
`Scored` it trains on (jaxcorr/train/rollouts/source.py).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxcorr.train.rollouts import dynamic_sampling
from jaxcorr.train.rollouts.stage import RolloutStage, Scored
from jaxcorr.train.tracker.reduction import Metric, Metrics

_POLL_S = 0.05


class AsyncRollouts:
  """Producer of `Scored` batches `start .. num_steps - 1` (module doc); a
  `rollout_source.RolloutSource`.

  Args:
    stage: generation and scoring (owns the engine).
    loader: the prompt loader; only the producer draws from it, each batch
      carries the loader state after its draw.
    weights: () -> a copy of the trainer's current weights (the weights of
      version `start` now, of each published version later).
    start: the first step to produce (the resumed step).
    num_steps: one past the last step.
    lag: `rollout.max_staleness`.
    queue_size: batches produced ahead of the trainer.
    history: `{version: weights}` of versions older than `start` that the
      first batches are sampled by (a checkpoint's `lagged`; module doc).
  """

  def __init__(
    self,
    stage: RolloutStage,
    loader: Any,
    weights: Callable[[], Any],
    *,
    start: int,
    num_steps: int,
    lag: int,
    queue_size: int,
    history: dict[int, Any] | None = None,
  ):
    self.stage = stage
    self.loader = loader
    self.weights = weights
    self.start, self.num_steps, self.lag = start, num_steps, lag
    self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
    self._published = {**(history or {}), start: weights()}
    self.first = min(self._published)
    self._cond = threading.Condition()
    self._stop = threading.Event()
    self._error: BaseException | None = None
    self._thread = threading.Thread(
      target=self._run, name='jaxcorr-rollout', daemon=True
    )
    self._thread.start()

  def version_for(self, step: int) -> int:
    return max(step - self.lag, self.first)

  def lagged(self, step: int) -> dict[int, Any]:
    """`{version: weights}` older than `step` that batches step ..
    step + lag − 1 are sampled by: what a checkpoint after step `step`
    holds for an exact resume (module doc)."""
    needed = {self.version_for(s) for s in range(step, step + self.lag)}
    with self._cond:
      return {v: self._published[v] for v in sorted(needed) if v < step}

  def publish(self, version: int) -> Metrics:
    """Hand the trainer's weights after step `version - 1` to the
    producer; returns `time/publish`."""
    t0 = time.perf_counter()
    self._publish(version, self.weights())
    return {'time/publish': Metric.avg(time.perf_counter() - t0)}

  def _publish(self, version: int, params: Any) -> None:
    with self._cond:
      self._published[version] = params
      # Versions below the oldest one any future batch needs are dropped.
      oldest = self.version_for(version)
      for v in [v for v in self._published if v < oldest]:
        del self._published[v]
      self._cond.notify_all()

  def _wait_version(self, v: int) -> Any:
    with self._cond:
      while v not in self._published:
        if self._stop.is_set():
          return None
        self._cond.wait(_POLL_S)
      return self._published[v]

  def _run(self) -> None:
    try:
      engine = self.stage.engine
      for step in range(self.start, self.num_steps):
        v = self.version_for(step)
        params = self._wait_version(v)
        if params is None:
          return
        sync_s = 0.0
        if engine.policy_version != v or step == self.start:
          t0 = time.perf_counter()
          engine.update_params(params, version=v)
          sync_s = time.perf_counter() - t0
        scored = dynamic_sampling.sample_step(self.stage, self.loader, step)
        scored.loader_state = self.loader.state()
        scored.metrics['time/weight_sync'] = Metric.avg(sync_s)
        while not self._stop.is_set():
          try:
            self._queue.put(scored, timeout=_POLL_S)
            break
          except queue.Full:
            continue
        if self._stop.is_set():
          return
    except BaseException as e:
      self._error = e

  def next(self) -> Scored:
    """The next batch, in step order (blocks; re-raises producer errors)."""
    t0 = time.perf_counter()
    while True:
      if self._error is not None:
        raise RuntimeError('the rollout producer failed') from self._error
      try:
        scored = self._queue.get(timeout=_POLL_S)
        wait = time.perf_counter() - t0
        scored.metrics['time/queue_wait'] = Metric.avg(wait)
        return scored
      except queue.Empty:
        if not self._thread.is_alive() and self._error is None:
          raise RuntimeError('the rollout producer stopped early') from None

  def close(self) -> None:
    self._stop.set()
    with self._cond:
      self._cond.notify_all()
    self._thread.join(timeout=60)
