"""NeMo-RL's sequence log-prob error mask on its own (NeMo-RL #3671).

The same computation as the RS criterion `seq_mean_mpe` of
`jaxcorr.losses.correction.rejection` (a sequence's error is the mean of
`exp(|log π_train − log μ|)` over its valid tokens), in NeMo's shape: a
sample mask in and out, a threshold that may be None (diagnostics only),
NeMo's metrics with the share of dropped sequences that were correct, and
their micro-batch reduction `reduce_seq_error_metrics`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxcorr.config import fields
from jaxcorr.losses import masked as mk
from jaxcorr.losses.correction import rejection


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
  `e_i = Σ_t mpe_t·m / n_i` (`rejection.mult_prob_error`; rows with `n_i = 0` have no
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
  err = mk.safe_div(mk.row_sum(rejection.mult_prob_error(delta), m), n)
  valid = n > 0
  keep = sample_mask
  if threshold is not None:
    keep = sample_mask & (err <= threshold)
  after = rejection.seq_error_metrics(err, keep, valid, rewards)
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
