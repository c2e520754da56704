"""The first jitted function of an RL step: everything the update reads
that is computed once on the global batch, before it is split.

    old log-probs   decoupled mode: the trainer's forward pass with the
                    pre-update params (bypass: π_old is μ, skipped; with
                    rollout.matched_precision the engine's quantized
                    weights, dequantized; with rollout.exact the exact
                    forward over the unpacked rows); with
                    `moe.router_replay='old'` also its routing (R2)
    ref log-probs   when a reference KL is configured
    values          the critic's, when it is enabled
    rewards         the sequence reward on the last response token, minus
                    the KL in reward (+ one controller step)
    advantages      `algorithm.advantage` (and the returns)
    correction      decoupled mode: the rollout correction's weights and
                    mask (bypass mode corrects inside the loss); off sync
                    mode its metrics are also split by version gap

Forward passes run in micro-batch-sized chunks (`scoring.in_chunks`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxcorr.losses import advantages as adv_lib
from jaxcorr.losses import correction as corr_lib
from jaxcorr.losses import masked, rewards
from jaxcorr.train import scoring
from jaxcorr.train.batch import TrainBatch
from jaxcorr.train.distill import direct as distill_direct
from jaxcorr.train.distill import rules as distill_rules
from jaxcorr.train.distill import score as distill_score
from jaxcorr.train.packing import forward as packed_forward
from jaxcorr.train.packing.layout import PackedRows
from jaxcorr.train.rollouts import staleness
from jaxcorr.train.rollouts.weights import matched_params
from jaxcorr.train.run_config import RunConfig


def _critic_values(
  graphdef: Any,
  params: Any,
  batch: TrainBatch,
  packed: PackedRows | None,
  chunks: int,
) -> jax.Array:
  """The critic's values `[B, T]`, in `chunks` micro-batch-sized chunks of
  rows or, with `packed`, over the packed rows (the update's memory)."""
  if packed is None:
    values = functools.partial(scoring.critic_values, graphdef)
    return scoring.in_chunks(values, params, batch, chunks)
  values = functools.partial(packed_forward.response_values, graphdef)
  return packed_forward.in_micro_batches(values, params, packed, batch.rows)


def prepare(
  run: RunConfig,
  graphdef: Any,
  critic_graphdef: Any,
  params: Any,
  critic_params: Any,
  kl_ctrl: rewards.KLControllerState,
  ref_params: Any,
  batch: TrainBatch,
  packed: PackedRows | None = None,
  teacher: Any = None,
) -> tuple[rewards.KLControllerState, TrainBatch, dict[str, jax.Array]]:
  """(the KL controller after this step, `batch` with the training fields
  filled, metrics of the global batch); with `packed` (`train.packing`)
  the forward passes run over its packed rows; with `teacher` (a
  `distill.teacher.Teacher`) the advantages are the distillation's, or
  with a direct `distill.loss` the teacher's fields the update reads."""
  alg = run.algorithm
  sg = jax.lax.stop_gradient
  mask = batch.response_mask
  chunks = run.train.mini_batches * run.train.micro_batches
  metrics: dict[str, jax.Array] = {}

  def logp(p, rows):
    return scoring.response_logp(run, graphdef, p, rows)

  def packed_logp(p, micro):
    return packed_forward.response_logp(run, graphdef, p, micro)

  def policy_logp(p):
    if packed is None:
      return sg(scoring.in_chunks(logp, p, batch, chunks))
    return sg(packed_forward.in_micro_batches(packed_logp, p, packed, b))

  b = batch.rows
  if run.decoupled:
    old = params
    if run.rollout.matched_precision:  # the engine's quantized weights
      old = matched_params(run, graphdef, params)
    old_logp, experts = _old_logp(run, graphdef, old, batch, policy_logp)
    batch = batch.replace(old_logp=sg(old_logp), old_experts=experts)
  if run.needs_ref:
    batch = batch.replace(ref_logp=policy_logp(ref_params))
  if run.critic.enabled:
    values = _critic_values(
      critic_graphdef, critic_params, batch, packed, chunks
    )
    batch = batch.replace(values=sg(values))
  scores = rewards.place_at_last_token(batch.seq_reward, mask)
  if alg.kl_in_reward is not None:
    scores, kl_ctrl, kl_metrics = _kl_in_reward(run, batch, scores, kl_ctrl)
    metrics.update(kl_metrics)
  adv, returns = adv_lib.advantages_from_config(
    alg.advantage, scores, mask, batch.group_ids, values=batch.values
  )
  batch = batch.replace(advantages=adv, returns=returns)
  if teacher is not None and distill_rules.is_direct(run):  # its inputs
    batch, distill_metrics = distill_direct.prepare_fields(run, teacher, batch)
    metrics.update(distill_metrics)
  elif teacher is not None:  # on-policy distillation (jaxcorr/train/distill)
    adv, distill_metrics = distill_score.distill_advantages(run, teacher, batch)
    batch = batch.replace(advantages=adv)
    metrics.update(distill_metrics)
  corr = run.losses.correction
  if run.decoupled and corr is not None:
    c = corr_lib.rollout_correction(
      batch.old_logp,
      batch.rollout_logp,
      mask,
      corr,
      **gap_arguments(run, batch.version_gap),
      seq_reward=batch.seq_reward,
    )
    batch = batch.replace(corr_weights=c.weights, corr_mask=c.mask)
    metrics.update(c.metrics)
  metrics.update(_batch_metrics(batch))
  return kl_ctrl, batch, metrics


def _routed_logp(run: RunConfig, graphdef: Any, p: Any, rows: TrainBatch):
  out, stats = scoring.response_logp(run, graphdef, p, rows, routing=True)
  return out, stats.experts


def _old_logp(run, graphdef, old, batch, policy_logp) -> tuple[Any, Any]:
  """(π_old `[B, T]`, its MoE routing for R2 or None): the exact forward
  (`rollout.exact`, over the batch's own rows), the routed forward whose
  routing every update micro-batch replays (R2:
  `moe.router_replay='old'`), or `policy_logp`."""
  r2 = run.moe.router_replay == 'old'
  if run.rollout.exact:
    fn = functools.partial(scoring.exact_logp, run, graphdef, routing=r2)
  elif r2:
    fn = functools.partial(_routed_logp, run, graphdef)
  else:
    return policy_logp(old), None
  chunks = run.train.mini_batches * run.train.micro_batches
  out = scoring.in_chunks(fn, old, batch, chunks)
  return out if r2 else (out, None)


def gap_arguments(run: RunConfig, version_gap: Any) -> dict[str, Any]:
  """`rollout_correction`'s per-version-gap arguments: none in sync mode;
  otherwise the batch's `[B, T]` gaps and `staleness.gap_buckets`, so the
  `rollout_corr/gap<g>/` key set is fixed by the config."""
  r = run.rollout
  buckets = staleness.gap_buckets(r.mode, r.max_staleness)
  if buckets is None:
    return {}
  if version_gap is None:
    raise ValueError(
      f'TrainBatch.version_gap is None with rollout.mode={r.mode!r}; the '
      'correction splits its metrics by version gap (batch.assemble fills it)'
    )
  return dict(version_gap=version_gap, gap_buckets=buckets)


def _kl_in_reward(
  run: RunConfig,
  batch: TrainBatch,
  scores: jax.Array,
  kl_ctrl: rewards.KLControllerState,
) -> tuple[jax.Array, rewards.KLControllerState, dict[str, jax.Array]]:
  """Token scores minus coef x KL(behaviour ‖ ref), and the controller's
  next coefficient."""
  alg = run.algorithm
  behaviour = batch.old_logp if run.decoupled else batch.rollout_logp
  scores, _, kl_metrics = rewards.apply_kl_penalty(
    scores,
    behaviour,
    batch.ref_logp,
    batch.response_mask,
    kl_ctrl.coef,
    estimator=alg.kl_penalty,
  )
  kl_ctrl = rewards.update_kl_controller(
    kl_ctrl,
    kl_metrics[rewards.KL_METRIC],
    run.rollout.batch_size,
    alg.kl_in_reward,
  )
  return scores, kl_ctrl, kl_metrics


def _batch_metrics(batch: TrainBatch) -> dict[str, jax.Array]:
  mask = batch.response_mask
  adv = batch.advantages
  metrics = {
    'advantages/mean': masked.masked_mean(adv, mask),
    'advantages/max': masked.masked_max(adv, mask),
    'advantages/min': masked.masked_min(adv, mask),
    'returns/mean': masked.masked_mean(batch.returns, mask),
    'batch/valid_rows': jnp.sum(jnp.any(mask, axis=-1), dtype=jnp.float32),
    'batch/valid_tokens': jnp.sum(mask, dtype=jnp.float32),
  }
  if batch.values is not None:
    metrics['critic/values_mean'] = masked.masked_mean(batch.values, mask)
  return metrics
