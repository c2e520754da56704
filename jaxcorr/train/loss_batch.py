"""What the update reads beyond `prepare`'s batch: the shapings placed at
the loss and VCPO (docs/algorithms.md).

    prepare's batch ─ VCPO's off-policy optimal baseline replaces the
    advantages (`actor.grad_baselining`) ─ the overlong shapings at the
    loss (`reward.mask_truncated_completions`, `reward.overlong_penalty_at
    ='loss'`) ─ the updates, each mini-batch's step scaled by its ESS
    (`actor.ess_scaling`)

The baseline is taken before the filter, so a truncated row stays a member
of its group (TRL's semantics, jaxcorr/losses/overlong.py); the ESS is of
the rows that train. The math is jaxcorr/losses/overlong.py and
jaxcorr/losses/vcpo.py; this module only feeds them the batch's arrays.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxcorr.losses import masked, vcpo
from jaxcorr.losses import overlong as overlong_lib
from jaxcorr.train.batch import TrainBatch
from jaxcorr.train.run_config import RunConfig

RowLogp = Callable[..., jax.Array]
"""`row_logp(key, params, row)`: Σ_t m_t log π_θ(y_t) of a one-row batch."""


# Per-row gradients held at once by `score_sq_norms`: rows are vmapped in
# chunks whose gradients fit this many bytes (all 128 rows of the lab's tiny
# model, one row of SmolLM2-135M's 540 MB); one row at a time made VCPO's
# tiny-model update 10x slower than the rest of the step.
SCORE_CHUNK_BYTES = 256 * 2**20


def score_chunk_rows(params: Any, rows: int) -> int:
  """Rows per vmapped chunk of `score_sq_norms`: as many per-row gradients
  as fit `SCORE_CHUNK_BYTES` (at least 1, at most `rows`)."""
  grad_bytes = sum(
    x.size * 4 for x in jax.tree.leaves(params) if hasattr(x, 'size')
  )
  return int(max(1, min(rows, SCORE_CHUNK_BYTES // max(grad_bytes, 1))))


def score_sq_norms(row_logp: RowLogp, params: Any, batch: TrainBatch):
  """‖∇_θ log π_θ(τ_i)‖² of every row, float32 `[B]`: one backward pass
  per row, as the authors' micro-batch-1 pass, vmapped over chunks of
  `score_chunk_rows` rows (`lax.map(batch_size=)`); at `params` (π_old:
  the update has not started)."""

  def one(i):
    row = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i, 1), batch)
    grads = jax.grad(row_logp)(params, row)
    return jnp.asarray(jax.tree.reduce(jnp.add, _squares(grads)), jnp.float32)

  chunk = score_chunk_rows(params, batch.rows)
  return jax.lax.map(one, jnp.arange(batch.rows), batch_size=chunk)


def _squares(tree: Any) -> Any:
  return jax.tree.map(
    lambda g: jnp.sum(jnp.square(g.astype(jnp.float32))), tree
  )


def vcpo_baseline(
  run: RunConfig, batch: TrainBatch, row_logp: RowLogp, key: Any, params: Any
) -> tuple[TrainBatch, dict[str, jax.Array]]:
  """`batch` with VCPO's advantages `R_i − b_g` (`vcpo.opob_baseline`,
  `vcpo.opob_advantages`) and the `vcpo/` baseline metrics."""
  k = run.losses.actor
  mask = batch.response_mask
  valid = jnp.any(mask, axis=-1)
  if k.baseline_score_norm == 'exact':
    norms = score_sq_norms(functools.partial(row_logp, key), params, batch)
  else:
    norms = jnp.ones(valid.shape, jnp.float32)
  log_w = vcpo.seq_log_weights(batch.old_logp, batch.rollout_logp, mask)
  baseline = vcpo.opob_baseline(
    batch.seq_reward,
    log_w,
    norms,
    masked.row_count(mask),
    batch.group_ids,
    valid,
    use_is_weights=k.baseline_use_is_weights,
    normalize_by_length=k.baseline_normalize_by_length,
  )
  adv = vcpo.opob_advantages(
    batch.seq_reward,
    baseline,
    mask,
    batch.group_ids,
    norm_by_std=k.baseline_norm_by_std,
    eps=run.algorithm.advantage.eps,
  )
  metrics = {
    'vcpo/baseline_mean': masked.rows_mean(baseline, valid),
    'vcpo/score_sq_norm_mean': masked.rows_mean(norms, valid),
  }
  return batch.replace(advantages=adv.astype(batch.advantages.dtype)), metrics


def for_update(
  run: RunConfig, batch: TrainBatch, row_logp: RowLogp, key: Any, state: Any
) -> tuple[TrainBatch, dict[str, jax.Array]]:
  """The batch the updates read (module docstring) and its metrics; the
  exact score norms differentiate `row_logp` at `state.params`."""
  metrics = {}
  if run.losses.actor.grad_baselining:
    batch, metrics = vcpo_baseline(run, batch, row_logp, key, state.params)
  if batch.truncated is not None or batch.overlong_penalty is not None:
    mask, adv = overlong_lib.shape_loss(
      batch.response_mask,
      batch.advantages,
      batch.truncated,
      batch.overlong_penalty,
    )
    batch = batch.replace(response_mask=mask, advantages=adv)
  return batch, metrics


def step_scale(
  run: RunConfig, mb: TrainBatch, metrics: dict[str, jax.Array]
) -> jax.Array | None:
  """VCPO's step multiplier of one mini-batch (`vcpo.ess_step_scale` of its
  `vcpo.ess_ratio`), its metrics added to `metrics`; None without
  `ess_scaling`."""
  k = run.losses.actor
  if not k.ess_scaling:
    return None
  mask = mb.response_mask
  log_w = vcpo.seq_log_weights(mb.old_logp, mb.rollout_logp, mask)
  rho = vcpo.ess_ratio(log_w, jnp.any(mask, axis=-1))
  scale = vcpo.ess_step_scale(
    rho, rule=k.ess_scaling_rule, base=k.ess_base_ratio
  )
  metrics.update({'vcpo/ess_ratio': rho, 'vcpo/step_scale': scale})
  return scale
