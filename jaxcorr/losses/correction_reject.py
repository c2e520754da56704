"""Rejection statistics of the 2026 frontier: KPop and sequence log-prob error.

* **KPop** (AReaL #1405): with p = π_train(y_t) and q = μ(y_t) the
  probabilities of the sampled token, the statistic is the larger of the two
  Bernoulli KLs, `max(KL(p‖q), KL(q‖p))`. It is the `bkl` token statistic of
  the RS criteria `token_bkl`, `seq_sum_bkl`, `seq_mean_bkl`, `seq_max_bkl`
  of `jaxcorr.losses.correction` (keep `stat ≤ up`). IcePop is the `token_k1`
  band with unbounded token IS weights (see docs/correction.md §2).
* **Sequence log-prob error masking** (NeMo-RL #3671): a sequence's error is
  the mean of `mpe_t = exp(|log π_train − log μ|)` (NeMo's "multiplicative
  probability error") over its valid tokens; sequences whose error exceeds a
  threshold leave the batch, and the share of them that were correct
  (reward exactly 1) is logged (`masked_correct_fraction`). In a config it
  is the RS criterion `seq_mean_mpe` of `jaxcorr.losses.correction`, whose
  extra metrics come from `seq_error_metrics`; `seq_logprob_error_mask` is
  the same computation alone, in NeMo's shape.

Everything is pure and jit-able; padding is zeroed at the inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxcorr.config import fields
from jaxcorr.losses import masked as mk

KPOP_EPS = 1e-8
"""Probability clamp of the Bernoulli KL: `p, 1 − p ≥ 1e-8` (AReaL's eps)."""


def bernoulli_kl(
  log_p: jax.Array, log_q: jax.Array, *, eps: float = KPOP_EPS
) -> jax.Array:
  """`KL(Bern(p) ‖ Bern(q))` from log-probabilities, finite everywhere.

  `p = clip(exp(log_p), eps, 1)`, `1 − p = max(−expm1(log_p), eps)`
  (likewise q); `KL = p·log(p/q) + (1 − p)·log((1 − p)/(1 − q))`. The floor
  is applied to `1 − p` itself, computed without cancellation: AReaL clamps
  p to `1 − eps`, which rounds to 1 in float32, so its `1 − p` can be 0 and
  a certain token (p = 1) gives `0·log 0 = NaN`, silently rejected (D24 in
  docs/correction.md); its float32 `1 − p` also loses digits when p ≈ 1.

  Args:
    log_p, log_q: float arrays of the same shape (log-probabilities).
    eps: the clamp.
  """
  p = jnp.clip(jnp.exp(log_p), eps, 1.0)
  q = jnp.clip(jnp.exp(log_q), eps, 1.0)
  p1 = jnp.maximum(-jnp.expm1(jnp.minimum(log_p, 0)), eps)
  q1 = jnp.maximum(-jnp.expm1(jnp.minimum(log_q, 0)), eps)
  return p * jnp.log(p / q) + p1 * jnp.log(p1 / q1)


def kpop_statistic(
  train_logp: jax.Array,
  rollout_logp: jax.Array,
  mask: jax.Array,
  *,
  eps: float = KPOP_EPS,
) -> jax.Array:
  """KPop's token statistic `max(KL(p‖q), KL(q‖p))`, 0 outside the mask.

  Args:
    train_logp: `[B, T]` log π_train (π_old or sg π_θ).
    rollout_logp: `[B, T]` log μ.
    mask: bool `[B, T]`.
    eps: probability clamp.
  """
  mk.check_mask(mask)
  mk.check_shapes({'train_logp': train_logp, 'rollout_logp': rollout_logp})
  lp = mk.sanitize(train_logp, mask)
  lq = mk.sanitize(rollout_logp, mask)
  stat = jnp.maximum(
    bernoulli_kl(lp, lq, eps=eps), bernoulli_kl(lq, lp, eps=eps)
  )
  return jnp.where(mask, stat, 0)


# ------------------------------------------ sequence log-prob error (NeMo)


def mult_prob_error(r: jax.Array) -> jax.Array:
  """NeMo's token error `mpe_t = exp(|r̂_t|) = max(ρ_t, 1/ρ_t) ≥ 1`.

  `r̂ = clip(r, ±20)` like every `exp` of a log-ratio here (D11 in
  docs/correction.md): NeMo exponentiates the raw `|Δ|`, which overflows
  to inf past |Δ| ≈ 88 in float32 and turns its mean and max metrics into
  inf; the verdict is the same for any threshold below e^20 ≈ 4.85e8.

  Args:
    r: `[B, T]` log-ratio `log π_train − log μ` (0 outside the mask).
  """
  return jnp.exp(jnp.minimum(jnp.abs(r), mk.SAFETY_BOUND))


def seq_error_metrics(
  err: jax.Array,
  keep: jax.Array,
  valid: jax.Array,
  seq_reward: jax.Array | None,
) -> dict[str, jax.Array]:
  """NeMo's after-mask statistics and masked-correct share of one verdict.

  Args:
    err: `[B]` sequence errors `e_i` (0 for empty rows).
    keep: bool `[B]` the verdict (`e_i ≤ threshold`, empty rows kept).
    valid: bool `[B]` non-empty rows.
    seq_reward: `[B]` sequence rewards, or None (then no
      `masked_correct_fraction`).

  Returns:
    `kept_seq_{mean,max,min}` over the kept non-empty rows (0 for an empty
    set, D14) and, with rewards, `masked_correct_fraction`: the share of
    the dropped non-empty rows whose reward is exactly 1 (0 when none was
    dropped).
  """
  kept = valid & keep
  out = {
    'kept_seq_mean': mk.rows_mean(err, kept),
    'kept_seq_max': mk.rows_max(err, kept),
    'kept_seq_min': mk.rows_min(err, kept),
  }
  if seq_reward is not None:
    dropped = valid & ~keep
    correct = dropped & (jnp.asarray(seq_reward) == 1)
    out['masked_correct_fraction'] = mk.safe_div(
      jnp.sum(correct, dtype=err.dtype), jnp.sum(dropped, dtype=err.dtype)
    )
  return out


def seq_logprob_error_mask(
  train_logp: jax.Array,
  rollout_logp: jax.Array,
  token_mask: jax.Array,
  sample_mask: jax.Array,
  rewards: jax.Array,
  *,
  threshold: float | None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Drops sequences whose mean `exp(|Δ log-prob|)` exceeds a threshold.

  With `m = token_mask ∧ sample_mask_i` and `n_i = Σ_t m`, the error is
  `e_i = Σ_t mpe_t·m / n_i` (`mult_prob_error`; rows with `n_i = 0` have no
  error and take no part in the statistics). With a threshold,
  `sample_mask_i ← sample_mask_i ∧ e_i ≤ threshold`; a masked sequence is
  "correct" when its reward is exactly 1.

  Args:
    train_logp, rollout_logp: `[B, T]` log π_train and log μ.
    token_mask: bool `[B, T]` valid response tokens.
    sample_mask: bool `[B]` sequences in the batch.
    rewards: `[B]` sequence rewards.
    threshold: the error bound (≥ 1), or None for diagnostics only.

  Returns:
    `(sample_mask_after [B] bool, metrics)` with `seq_mult_prob_error_{max,
    mean,min}` over the non-empty sequences, the same `_after_mask` over the
    kept ones (0 for an empty set, D14), `num_masked_seqs`,
    `masked_correct_fraction` (0 when nothing was masked) and
    `num_valid_seqs_{before,after}` (the weights of a count-weighted
    reduction, `reduce_seq_error_metrics`).
  """
  mk.check_mask(token_mask, 'token_mask')
  mk.check_mask(sample_mask, 'sample_mask')
  mk.check_shapes(
    {
      'train_logp': train_logp,
      'rollout_logp': rollout_logp,
      'token_mask': token_mask,
    }
  )
  mk.check_shapes({'sample_mask': sample_mask, 'rewards': rewards}, ndim=1)
  if threshold is not None and not (
    fields.is_number(threshold) and math.isfinite(threshold) and threshold >= 1
  ):
    raise ValueError(
      f'threshold={threshold!r} is invalid; allowed: a finite number >= 1 '
      '(every error is >= 1, so a smaller one drops every sequence) or None'
    )
  m = token_mask & sample_mask[:, None]
  dtype = mk.float_dtype(train_logp, rollout_logp)
  delta = mk.sanitize(train_logp, m, dtype) - mk.sanitize(
    rollout_logp, m, dtype
  )
  n = mk.row_count(m, dtype)
  err = mk.safe_div(mk.row_sum(mult_prob_error(delta), m), n)
  valid = n > 0
  keep = sample_mask
  if threshold is not None:
    keep = sample_mask & (err <= threshold)
  after = seq_error_metrics(err, keep, valid, rewards)
  metrics = {
    'seq_mult_prob_error_max': mk.rows_max(err, valid),
    'seq_mult_prob_error_mean': mk.rows_mean(err, valid),
    'seq_mult_prob_error_min': mk.rows_min(err, valid),
    'seq_mult_prob_error_max_after_mask': after['kept_seq_max'],
    'seq_mult_prob_error_mean_after_mask': after['kept_seq_mean'],
    'seq_mult_prob_error_min_after_mask': after['kept_seq_min'],
    # A dropped row is non-empty: an empty one has error 0 < 1 ≤ threshold.
    'num_masked_seqs': jnp.sum(sample_mask & ~keep, dtype=dtype),
    'masked_correct_fraction': after['masked_correct_fraction'],
    'num_valid_seqs_before': jnp.sum(valid, dtype=dtype),
    'num_valid_seqs_after': jnp.sum(valid & keep, dtype=dtype),
  }
  return jax.lax.stop_gradient(keep), jax.lax.stop_gradient(metrics)


def reduce_seq_error_metrics(
  parts: Sequence[dict[str, jax.Array]],
) -> dict[str, jax.Array]:
  """Combines `seq_logprob_error_mask` metrics of several micro-batches.

  Means are weighted by the valid-sequence counts (`_after_mask` by the
  kept counts), max of maxes and min of mins over parts that have a
  sequence, `num_masked_seqs` summed, `masked_correct_fraction` weighted by
  each part's masked count. Equals the metrics of one call on the
  concatenated batch.
  """
  out: dict[str, jax.Array] = {}
  for suffix, count in (('', 'before'), ('_after_mask', 'after')):
    w = jnp.stack([p[f'num_valid_seqs_{count}'] for p in parts])
    has = w > 0

    def col(stat, suffix=suffix):
      return jnp.stack(
        [p[f'seq_mult_prob_error_{stat}{suffix}'] for p in parts]
      )

    out[f'seq_mult_prob_error_mean{suffix}'] = mk.safe_div(
      jnp.sum(w * col('mean')), jnp.sum(w)
    )
    out[f'seq_mult_prob_error_max{suffix}'] = mk.rows_max(col('max'), has)
    out[f'seq_mult_prob_error_min{suffix}'] = mk.rows_min(col('min'), has)
    out[f'num_valid_seqs_{count}'] = jnp.sum(w)
  masked = jnp.stack([p['num_masked_seqs'] for p in parts])
  frac = jnp.stack([p['masked_correct_fraction'] for p in parts])
  out['num_masked_seqs'] = jnp.sum(masked)
  out['masked_correct_fraction'] = mk.safe_div(
    jnp.sum(masked * frac), jnp.sum(masked)
  )
  return out
