"""Streaming rollouts: continuous decoding across batches, weights swapped
into the engine between decode chunks while sequences are in flight.

    producer thread, one loop per decode chunk:
      weights   take a published version (`rollout.weight_sync`), with the
                live rows' KV kept or recomputed (`rollout.kv_on_update`)
      submit    draw d's prompts (all samples) once the draw window and
                the staleness bound allow it
      advance   one chunk (`rollout.decoder.Decoder`); rows finish
      emit      draw e's batch once all its rows finished, in draw order:
                score it and hand it to the trainer (bounded queue)
    trainer:    next() -> batch s (= draw s) ── update ── publish(s + 1)

Batch s holds exactly the prompts of draw s (the loader's s-th batch),
whatever finishes first: taking rows in completion order would favour short
responses, and a fixed draw order keeps the data order and the resume
position of a sync run. Its rows may have been sampled by several versions:
each token records the one that sampled it, and since batch s trains at
trainer version s, a token's staleness is s minus its version.

The staleness bound L = `rollout.max_staleness` (`rollout.staleness_policy`):

* 'wait': draw d is submitted only once the engine holds version >= d - L,
  and versions only grow, so every token's staleness is <= L; the engine
  waits for the trainer when it is that far ahead.
* 'drop' / 'mask': draws are submitted without waiting for weights; the
  trainer drops the rows (or masks the tokens) staler than L
  (jaxcorr/train/batch.py). The producer decodes a chunk only if a draw
  in flight is at most L versions ahead of the engine's weights (the
  chunk samples a token that trains), else it waits for newer weights:
  without that bound it ran as far ahead as its queues allow, and every
  batch from the third on was dropped whole. With `queue_size` 1 no token
  is lost; with more, rows of the younger draws sampled alongside the
  oldest may be (`rollout/token_keep_fraction`). A run of batches with
  nothing left stops the run (`staleness.EmptyBatches`).

Draws run at most `rollout.queue_size` ahead of the oldest unfinished one,
and finished batches wait in a queue of that size.

`weight_sync='latest'` swaps in the newest published version at each chunk
boundary (PipelineRL); where the swaps fall depends on thread timing.
`'scheduled'` makes them a function of the producer's own progress: before
each chunk the engine holds exactly version max(b(e), e - min(L, 1)), e =
batches finished so far, waiting for it to be published. Decoding is
deterministic, so the whole stream (tokens, versions, log-probs) is
reproducible run to run.

Multi-turn rollouts (`config.agent`): each sample is an episode of an
`agents.driver.AgentDecoder` instead of a request of a `Decoder`, swaps
fall between its rounds, and draw e's batch is the finished trajectories
scored as in sync mode (`RolloutStage.score_agents`). A trajectory may
span versions: each agent token keeps its own (environment tokens have
none), so the bound and the policies above act per agent token.

Dynamic sampling (`dynamic_sampling.enabled`,
jaxcorr/train/rollouts/dynamic_sampling.py) runs here, at the producer:
when the head draw finishes and its kept groups fall short, the loader's
next batch is submitted as another round of that draw while the later
draws go on decoding; the draw is emitted once full. A step's loader
state is then the loader's after its last round, exact at the drained
checkpoints below.

Resume: a checkpoint after step s records the loader state after draw s,
so a resumed run draws the same prompts from s + 1 on; rows in flight at
the checkpoint are not saved. With 'scheduled' swaps the stream drains at
every checkpoint step c (multiples of `train.checkpoint_every`): draw d
starts only once every earlier draw finished and the engine holds version
b(d) = max(start, c) for the last such c <= d, which is exactly the state
a run resumed from c starts in, so resuming from a periodic checkpoint is
exact (one pipeline stall per checkpoint interval). With 'latest' swaps,
or from a checkpoint off that grid (a preemption), the rows in flight are
sampled again from their first token under the resumed weights: the same
prompts, other tokens (docs/async.md).
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxcorr.agents.driver import Episode
from jaxcorr.rollout import driver
from jaxcorr.rollout.decoder import Decoder, Request
from jaxcorr.rollout.state import SamplingParams
from jaxcorr.train.rollouts import dynamic_sampling
from jaxcorr.train.rollouts.stage import RolloutStage, Scored, step_seed
from jaxcorr.train.run_config import RunConfig
from jaxcorr.train.tracker.reduction import Metric, Metrics

_POLL_S = 0.05


@dataclasses.dataclass
class _Draw:
  """One loader batch in flight: its prompts, requests and timings."""

  step: int
  examples: list
  loader_state: dict
  pending: int  # requests (or episodes) not finished yet
  done: list = dataclasses.field(default_factory=list)
  t_submit: float = 0.0
  swaps: int = 0  # weight swaps while its rows were in flight
  sync_s: float = 0.0  # time spent swapping them in
  filler: Any = None  # its rounds under dynamic sampling, else None


class StreamRollouts:
  """Producer of `Scored` batches `start .. num_steps - 1` (module doc); a
  `rollout_source.RolloutSource`.

  Args:
    run: the run config (rollout.* knobs, train.seed).
    stage: generation and scoring (owns the engine).
    loader: the prompt loader; only the producer draws from it.
    weights: () -> a copy of the trainer's current weights.
    start: the first step to produce (the resumed step).
    num_steps: one past the last step.
  """

  def __init__(
    self,
    run: RunConfig,
    stage: RolloutStage,
    loader: Any,
    weights: Callable[[], Any],
    *,
    start: int,
    num_steps: int,
  ):
    r = run.rollout
    self.run, self.stage, self.loader = run, stage, loader
    self.weights = weights
    self.start, self.num_steps = start, num_steps
    self.lag, self.ahead = r.max_staleness, r.queue_size
    self.wait_for_weights = r.staleness_policy == 'wait'
    self.scheduled = r.weight_sync == 'scheduled'
    self.recompute = r.kv_on_update == 'recompute'
    sp = SamplingParams(r.temperature, r.top_k, r.top_p, r.min_p)
    lane = _Completions if stage.agents is None else _Trajectories
    self.lane = lane(stage, sp)
    self._published = {start: weights()}
    self._cond = threading.Condition()
    self._ready: queue.Queue = queue.Queue(maxsize=self.ahead)
    self._stop = threading.Event()
    self._error: BaseException | None = None
    self._idle_s = 0.0  # producer time spent waiting since the last emit
    self._t_emit = time.perf_counter()
    self._t_next: float | None = None
    self._thread = threading.Thread(
      target=self._run, name='jaxcorr-stream', daemon=True
    )
    self._thread.start()

  # ----------------------------------------------------------- trainer

  def next(self) -> Scored:
    """The next batch, in step order (blocks; re-raises producer errors)."""
    t0 = time.perf_counter()
    depth = self._ready.qsize()
    while True:
      if self._error is not None:
        raise RuntimeError('the rollout producer failed') from self._error
      try:
        scored = self._ready.get(timeout=_POLL_S)
        break
      except queue.Empty:
        if not self._thread.is_alive() and self._error is None:
          raise RuntimeError('the rollout producer stopped early') from None
    now = time.perf_counter()
    wait = now - t0
    busy = now - self._t_next if self._t_next is not None else wait
    self._t_next = now
    scored.metrics['time/queue_wait'] = Metric.avg(wait)
    scored.metrics['stream/queue_depth'] = Metric.avg(float(depth))
    scored.metrics['stream/trainer_idle_fraction'] = Metric.avg(
      wait / busy if busy > 0 else 0.0
    )
    return scored

  def publish(self, version: int) -> Metrics:
    """Hand the trainer's weights after step `version - 1` to the
    producer; returns `time/publish`."""
    t0 = time.perf_counter()
    params = self.weights()
    with self._cond:
      self._published[version] = params
      self._cond.notify_all()
    return {'time/publish': Metric.avg(time.perf_counter() - t0)}

  def lagged(self, step: int) -> dict[int, Any]:
    # Rows in flight are not saved (module doc, "Resume").
    return {}

  def close(self) -> None:
    self._stop.set()
    with self._cond:
      self._cond.notify_all()
    self._thread.join(timeout=60)
    self.lane.close()

  # ---------------------------------------------------------- producer

  def _run(self) -> None:
    try:
      engine = self.stage.engine
      engine.update_params(self._published[self.start], version=self.start)
      draws: collections.OrderedDict[int, _Draw] = collections.OrderedDict()
      next_draw, emitted = self.start, self.start
      while emitted < self.num_steps and not self._stop.is_set():
        self._take_weights(emitted, draws)
        while self._may_submit(next_draw, emitted):
          draws[next_draw] = self._submit(next_draw)
          next_draw += 1
        if not self.lane.busy or not self._trains(draws):
          # Nothing may start, or nothing the next chunk samples would
          # train, before newer weights arrive.
          self._wait(lambda: self._newest() > engine.policy_version)
          continue
        for tag, item in self.lane.advance():
          draw = draws[tag]
          draw.done.append(item)
          draw.pending -= 1
        while draws and next(iter(draws.values())).pending == 0:
          scored = self._score(draws[emitted])
          if scored is None:
            break  # a back-fill round of the head draw is in flight
          self._emit(draws.pop(emitted), scored)
          emitted += 1
    except BaseException as e:
      self._error = e

  def _trains(self, draws: dict) -> bool:
    """Whether the next chunk samples a token that trains: one of a draw
    at most `lag` versions ahead of the engine's weights (draw d trains at
    version d). 'drop' and 'mask' lose the others' tokens, so a producer
    with only those in flight waits for the trainer instead of running
    away; 'wait' never submits one."""
    v = self.stage.engine.policy_version
    return any(d - v <= self.lag for d, draw in draws.items() if draw.pending)

  def _newest(self) -> int:
    with self._cond:
      return max(self._published)

  def _wait(self, ready: Callable[[], bool]) -> None:
    """Block until `ready()` or close(); the time counts as engine idle."""
    t0 = time.perf_counter()
    with self._cond:
      while not ready() and not self._stop.is_set():
        self._cond.wait(_POLL_S)
    self._idle_s += time.perf_counter() - t0

  def _take_weights(self, emitted: int, draws: dict) -> None:
    """The version for the next chunk (module docstring), swapped in."""
    engine = self.stage.engine
    if self.scheduled:
      target = max(self._barrier(emitted), emitted - min(self.lag, 1))
      self._wait(lambda: target in self._published)
    else:
      target = self._newest()
    if target <= engine.policy_version or self._stop.is_set():
      return
    with self._cond:
      params = self._published[target]
      # Older versions are never needed again.
      for v in [v for v in self._published if v < target]:
        del self._published[v]
    t0 = time.perf_counter()
    self.lane.swap(params, target, recompute=self.recompute)
    dt = time.perf_counter() - t0
    for draw in draws.values():
      if draw.pending:
        draw.swaps += 1
        draw.sync_s += dt

  def _barrier(self, d: int) -> int:
    """b(d): the last checkpoint step <= d, or `start` (scheduled swaps
    only: the stream drains there, module docstring)."""
    every = self.run.train.checkpoint_every
    if not self.scheduled or every <= 0:
      return self.start
    return max(self.start, d // every * every)

  def _may_submit(self, d: int, emitted: int) -> bool:
    if d >= self.num_steps or d >= emitted + self.ahead:
      return False
    b = self._barrier(d)
    if b > self.start and (emitted < b or self.stage.engine.policy_version < b):
      return False
    if self.wait_for_weights:
      return d <= self.stage.engine.policy_version + self.lag
    return True

  def _submit(self, d: int) -> _Draw:
    """Draw d's prompts, every sample submitted (keys as in sync mode)."""
    draw = _Draw(step=d, examples=[], loader_state={}, pending=0)
    if self.run.dynamic_sampling.enabled:
      names = self.stage.scorer.names
      draw.filler = dynamic_sampling.Filler(self.run, names, d)
    self._submit_round(draw)
    return draw

  def _submit_round(self, draw: _Draw) -> None:
    """The loader's next batch for `draw` (its next round under dynamic
    sampling: keys offset as in sync mode, `dynamic_sampling.first_prompt`)."""
    examples = self.loader.next_batch()
    n = self.run.rollout.samples_per_prompt
    rounds = draw.filler.rounds if draw.filler else 0
    keys = driver.request_keys(
      step_seed(self.run.train.seed, draw.step),
      dynamic_sampling.first_prompt(rounds, len(examples)),
      len(examples),
      n,
    )
    draw.examples, draw.done = examples, []
    draw.loader_state = self.loader.state()
    draw.pending = self.lane.submit(draw.step, examples, keys, n)
    draw.t_submit = time.perf_counter()

  def _score(self, draw: _Draw) -> Scored | None:
    """The finished head draw's batch, or None when dynamic sampling
    submitted another round for it (the later draws keep decoding: the
    trainer waits only if the queue runs dry)."""
    scored = self.lane.score(draw, time.perf_counter() - draw.t_submit)
    if draw.filler is None:
      return scored
    if draw.filler.add(scored):
      self._submit_round(draw)
      return None
    # The loader after every round of this draw; draws submitted after it
    # drew theirs before its back-fill, so only a drained stream (a
    # checkpoint step with scheduled swaps) resumes exactly from it.
    draw.loader_state = self.loader.state()
    return draw.filler.result()

  def _emit(self, draw: _Draw, scored: Scored) -> None:
    scored.loader_state = draw.loader_state
    now = time.perf_counter()
    span = now - self._t_emit
    scored.metrics.update(
      {
        'time/weight_sync': Metric.avg(draw.sync_s),
        'stream/swaps_in_flight': Metric.avg(float(draw.swaps)),
        'stream/engine_idle_fraction': Metric.avg(
          self._idle_s / span if span > 0 else 0.0
        ),
      }
    )
    self._idle_s, self._t_emit = 0.0, now
    t0 = time.perf_counter()
    while not self._stop.is_set():
      try:
        self._ready.put(scored, timeout=_POLL_S)
        break
      except queue.Full:
        continue
    self._idle_s += time.perf_counter() - t0


class _Completions:
  """Single-turn rows: each sample a `Request` of a `Decoder`."""

  def __init__(self, stage: RolloutStage, sp: SamplingParams):
    self.stage = stage
    self.max_new_tokens = stage.run.rollout.max_new_tokens
    self.decoder = Decoder(
      stage.engine,
      sp=sp,
      max_new_tokens=self.max_new_tokens,
      stop_token_ids=stage.stop_ids,
    )

  @property
  def busy(self) -> bool:
    return self.decoder.busy

  def submit(self, d: int, examples: list, keys, n: int) -> int:
    prompts = self.stage.encode(examples)
    for i, prompt in enumerate(prompts):
      for s in range(n):
        row = i * n + s
        self.decoder.submit(Request(row, i, s, prompt, keys[row], tag=d))
    return len(prompts) * n

  def advance(self) -> list[tuple[int, Request]]:
    return [(req.tag, req) for req in self.decoder.advance()]

  def swap(self, params: Any, version: int, *, recompute: bool) -> None:
    self.decoder.swap(params, version, recompute=recompute)

  def score(self, draw: _Draw, rollout_s: float) -> Scored:
    done = sorted(draw.done, key=lambda q: q.row)
    engine, sp = self.stage.engine, self.decoder.sp
    batch = driver.to_batch(engine, done, self.max_new_tokens, sp)
    return self.stage.score(
      draw.examples, batch, step=draw.step, rollout_s=rollout_s
    )

  def close(self) -> None:
    pass


class _Trajectories:
  """Multi-turn rows (`config.agent`): each sample an `Episode` of the
  stage's `AgentRollouts`, all on one `AgentDecoder` for the run."""

  def __init__(self, stage: RolloutStage, sp: SamplingParams):
    self.stage, self.sp = stage, sp
    self.decoder = stage.agents.decoder(sp)
    self._env_s, self._t = 0.0, time.perf_counter()

  @property
  def busy(self) -> bool:
    return self.decoder.busy

  def submit(self, d: int, examples: list, keys, n: int) -> int:
    episodes = self.stage.agents.episodes(examples, keys, n, tag=d)
    for ep in episodes:
      self.decoder.submit(ep)
    return len(episodes)

  def advance(self) -> list[tuple[int, Episode]]:
    return [(ep.tag, ep) for ep in self.decoder.advance()]

  def swap(self, params: Any, version: int, *, recompute: bool) -> None:
    self.decoder.swap(params, version, recompute=recompute)

  def score(self, draw: _Draw, rollout_s: float) -> Scored:
    # Draws overlap, so the environments' share is of the producer's time
    # since the previous batch (as stream/engine_idle_fraction).
    now, env_s = time.perf_counter(), self.decoder.env_seconds
    share = (env_s - self._env_s) / max(now - self._t, 1e-9)
    self._env_s, self._t = env_s, now
    out = self.stage.agents.collect(draw.done, self.sp, env_time_share=share)
    return self.stage.score_agents(
      draw.examples, out, step=draw.step, rollout_s=rollout_s
    )

  def close(self) -> None:
    self.decoder.close()
