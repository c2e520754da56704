"""One RL update on a scored batch: the host side around the two compiled
functions.

    Scored ─ validate (the rollout contract) ─ rollout metrics, error and
    staleness checks ─ assemble (drop or mask stale data by
    rollout.staleness_policy, pick μ, the overlong shaping of the
    `reward` section, pad; numpy `TrainBatch`)
    ─ to_device ─ pack (train.packing: the whole batch, on every process)
    ─ Steps.prepare ─ Steps.update ─ metrics ─ a run of
    batches with no token left stops the run (`staleness.EmptyBatches`)

Host metrics (`rollout/`, `reward/`, `response_length/`, the reward
functions') are computed on this process's rows and combined over
processes by their kinds (`reduction.gather_processes`); device metrics
are of the global batch already.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from jaxcorr.rollout import ValidationConfig, validate_rollout_batch
from jaxcorr.train import batch as batch_lib
from jaxcorr.train.distill import teacher as distill_teacher
from jaxcorr.train.packing import forward as packed_forward
from jaxcorr.train.packing import layout as packing
from jaxcorr.train.rollouts import staleness
from jaxcorr.train.rollouts.stage import Scored
from jaxcorr.train.run_config import RunConfig
from jaxcorr.train.state import TrainState
from jaxcorr.train.step import Steps
from jaxcorr.train.tracker import diagnostics, metrics, reduction, traces
from jaxcorr.train.tracker.reduction import Metric, Metrics


class _ReadyTime:
  """The host time at which `tree` becomes ready, taken on a thread of its
  own so the caller goes on dispatching."""

  def __init__(self, tree: Any):
    self._time = 0.0
    self._thread = threading.Thread(target=self._watch, args=(tree,))
    self._thread.daemon = True
    self._thread.start()

  def _watch(self, tree: Any) -> None:
    jax.block_until_ready(tree)
    self._time = time.perf_counter()

  def wait(self) -> float:
    self._thread.join()
    return self._time


class RLStep:
  """`rl_step(state, ref_params, scored, step)` -> (state, metrics).

  Args:
    run: the validated run config.
    steps: the compiled prepare and update.
    mesh: the trainer's mesh.
    vocab_size: the policy's vocabulary (rollout validation).
    batch_shards: devices the rows are split over (padding multiple).
  """

  def __init__(
    self,
    run: RunConfig,
    steps: Steps,
    mesh: jax.sharding.Mesh,
    *,
    vocab_size: int,
    batch_shards: int,
    tracer: traces.Tracer | None = None,
  ):
    self.tracer = tracer  # train.trace_every (tracker/traces.py)
    self.run = run
    self.steps = steps
    self.mesh = mesh
    self.vocab_size = vocab_size
    t = run.train
    local_shards = max(batch_shards // jax.process_count(), 1)
    self.row_multiple = t.mini_batches * t.micro_batches * local_shards
    self.batch_shards = batch_shards
    self.teacher = distill_teacher.for_run(run, mesh)  # None: no config.distill
    r = run.rollout
    self.empty = staleness.EmptyBatches(
      limit=r.max_empty_batches,
      policy=r.staleness_policy,
      max_staleness=r.max_staleness,
      queue_size=r.queue_size,
    )

  def validation(self, trainer_version: int) -> ValidationConfig:
    r = self.run.rollout
    return ValidationConfig(
      vocab_size=self.vocab_size,
      temperature=r.temperature,
      top_k=r.top_k,
      top_p=r.top_p,
      min_p=r.min_p,
      samples_per_prompt=r.samples_per_prompt,
      needs_rollout_logp=True,
      logprob_mode=r.logprob_mode,
      allow_nonfinite_logp=r.allow_nonfinite_logp,
      trainer_version=trainer_version,
      routing=self.steps.routing,
      needs_routing=self.run.moe.router_replay == 'rollout',
    )

  def host_metrics(self, scored: Scored, step: int) -> Metrics:
    """Validate the batch; its rollout metrics (this process's rows).
    Raises when too many rows are engine ERRORs."""
    r = self.run.rollout
    validate_rollout_batch(scored.batch, self.validation(step))
    host = batch_lib.rollout_metrics(
      scored.batch,
      scored.rewards,
      trainer_version=step,
      max_staleness=r.max_staleness,
      staleness_policy=r.staleness_policy,
      gap_buckets=staleness.gap_buckets(r.mode, r.max_staleness),
      overlong=self.run.reward,
      max_len=r.max_new_tokens,
    )
    errors = host['rollout/finish_error_fraction'].value
    if errors > r.max_error_fraction:
      raise RuntimeError(
        f'{errors:.1%} of the rollouts are ERROR rows > '
        f'config.rollout.max_error_fraction={r.max_error_fraction}'
      )
    staleness_max = host['rollout/staleness_max'].value
    bound = r.max_staleness
    waits = r.staleness_policy == 'wait'
    if waits and bound is not None and staleness_max > bound:
      # Rows above the bound are dropped by `assemble`; a waiting producer
      # never delivers one, so it is worth a log line ('drop' and 'mask'
      # expect them: rollout/stale_dropped_fraction counts them).
      logging.warning('staleness %d > max %d', staleness_max, bound)
    return host

  def assemble(self, scored: Scored, step: int) -> batch_lib.TrainBatch:
    """This process's rows as a host `TrainBatch`, group ids made global."""
    r = self.run.rollout
    batch = batch_lib.assemble(
      scored.batch,
      scored.rewards,
      trainer_version=step,
      max_staleness=r.max_staleness,
      logprob_mode=r.logprob_mode,
      row_multiple=self.row_multiple,
      staleness_policy=r.staleness_policy,
      overlong=self.run.reward,
      max_len=r.max_new_tokens,
    )
    offset = jax.process_index() * batch.rows
    return batch.replace(group_ids=batch.group_ids + offset)

  def pack(
    self, batch: batch_lib.TrainBatch, device_batch: Any, step: int
  ) -> Any:
    """`train.packing`: the global batch's `PackedRows` (rows shuffled on
    the host from (train.seed, step) when the mini-batches are shuffled).

    A packed row of one data shard holds sequences of any process's rows,
    so with several processes each one gathers every row (`device_batch`,
    in its global order) and lays out the whole batch, as the others do:
    the layout is a pure function of the rows, identical everywhere, and
    each process then puts only its own shards on its devices."""
    if jax.process_count() > 1:
      batch = multihost_utils.process_allgather(device_batch, tiled=True)
    t = self.run.train
    order = None
    if t.shuffle_minibatches:
      rng = np.random.default_rng((t.seed, step))
      order = rng.permutation(batch.rows)
    return packing.pack(
      batch,
      mini_batches=t.mini_batches,
      micro_batches=t.micro_batches,
      shards=self.batch_shards,
      order=order,
    )

  def __call__(
    self, state: TrainState, ref_params: Any, scored: Scored, step: int
  ) -> tuple[TrainState, dict[str, float]]:
    rb = scored.batch
    t_host = time.perf_counter()
    host = self.host_metrics(scored, step)
    batch = self.assemble(scored, step)
    device_batch = batch_lib.to_device(self.mesh, batch)
    packed = None
    if self.run.train.packing:
      packed = self.pack(batch, device_batch, step)
    light = not diagnostics.full_step(step, self.run.train.metrics_every)
    t0 = time.perf_counter()
    with jax.set_mesh(self.mesh):
      if packed is not None:
        fill = packing.packed_tokens(packed) / packed.tokens.size
        packed = packed_forward.to_device(self.mesh, packed)
      kl_ctrl, train_batch, prep = self.steps.prepare(
        state.policy_params(),
        state.critic_params,
        state.kl_ctrl,
        state.policy_params(ref_params) if ref_params is not None else None,
        device_batch,
        packed,
        light=light,
        teacher=self.teacher,
      )
      # When prepare's outputs are ready, seen from a watcher thread: the
      # update is dispatched at once behind it, so timing never serialises
      # the two.
      prepared = _ReadyTime(train_batch)
      # Same shardings as the update's outputs (a no-op after the first
      # step), so the update compiles once.
      state = jax.device_put(
        state.replace(kl_ctrl=kl_ctrl), self.steps.state_shardings
      )
      state, upd = self.steps.update(state, train_batch, packed, light=light)
      device_metrics = metrics.to_host_scalars({**prep, **upd})
    t2 = time.perf_counter()
    t1 = min(prepared.wait(), t2)  # the watcher may wake late
    if self.tracer is not None and self.tracer.due(step + 1):
      # After the metrics' fetch: the gather waits on nothing new.
      with jax.set_mesh(self.mesh):
        params = state.policy_params()
        self.tracer.record(step + 1, scored, batch, train_batch, params)
      device_metrics['time/trace'] = time.perf_counter() - t2
    tokens = int(np.asarray(rb.context_mask).sum())
    tokens += int(np.asarray(rb.prompt_mask).sum())
    host = reduction.gather_processes(
      {**scored.metrics, **host, 'perf/train_tokens': Metric.sum(float(tokens))}
    )
    train_tokens = host.pop('perf/train_tokens')  # all processes' tokens
    out = {**host, **device_metrics}
    # Warns, then stops a run of updates on nothing (staleness.py).
    self.empty.check(step, out['batch/valid_tokens'], out)
    out['time/prepare'] = t1 - t0
    out['time/update'] = t2 - t1
    # The update's host work (validation, assembly, packing, metrics) and
    # its device time (dispatch to the last result on the host).
    out['time/train_device'] = t2 - t0
    out['time/train_host'] = time.perf_counter() - t_host - (t2 - t0)
    out['time/train_host'] -= out.get('time/trace', 0.0)
    out['rollout/policy_version'] = float(scored.version)
    out['perf/train_tokens'] = train_tokens
    if packed is not None:  # real tokens / tokens the packed rows compute
      out['perf/packed_fill'] = fill
    return state, out
