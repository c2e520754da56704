"""Diagnostics of the rollout correction (docs/math/correction.md §5).

Every function here returns a dict of scalars *without* the `rollout_corr/`
prefix; `correction.rollout_correction` adds it. All statistics use the
statistics mask `m` (valid and finite rows, before any rejection), and every
reduction returns 0 on an empty set (D14). Sequence statistics average over
the non-empty rows `V` only (D4).

Notation (docs/math/correction.md §4.1): `r = log ρ` the unclamped
log-ratio `[B, T]`, `r̂ = clip(r, ±20)`, `S_i = Σ_t r·m`, `q_i = rmean(w)_i`,
`valid` marks the rows of `V`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxcorr.losses import masked as mk

Metrics = dict[str, jax.Array]

_EXP_CAP = mk.SAFETY_BOUND


def _frac(cond: jax.Array, mask: jax.Array, dtype: jnp.dtype) -> jax.Array:
  """Fraction of the masked entries where `cond` holds (0 on an empty mask)."""
  return mk.masked_mean(cond.astype(dtype), mask)


def _row_weighted_mean(
  y: jax.Array, n: jax.Array, total: jax.Array
) -> jax.Array:
  """`mmean` of a `[B]` row value broadcast over its row: `Σ n_i·y_i / Σ n`."""
  return mk.safe_div(jnp.sum(jnp.where(n > 0, n * y, 0)), total)


def _minus_one(x: jax.Array, nonempty: jax.Array) -> jax.Array:
  """`x − 1`, but 0 on an empty set (where `x` is the empty mean 0)."""
  return jnp.where(nonempty, x - 1, jnp.zeros((), x.dtype))


def _pooled_std(
  x: jax.Array,
  m: jax.Array,
  mean: jax.Array | None = None,
  total: jax.Array | None = None,
) -> jax.Array:
  """`sqrt(max(mmean(x²) − mmean(x)², 0))` if `Σm > 1`, else 0 (verl).

  Evaluated in the two-pass form `mmean((x − mmean(x))²)`, the same
  quantity without the cancellation of the one-pass form (verl's float32
  one-pass value is off by ~4e-6 relative; README "dtypes and tolerances"),
  so it stays invariant under row permutation and sharding. `mean` and
  `total` (`mmean(x)`, `Σm`) may be passed when already known.
  """
  if total is None:
    total = mk.count(m, x.dtype)
  if mean is None:
    mean = mk.safe_div(mk.masked_sum(x, m), total)
  centred = jnp.where(m, x - mean, jnp.zeros((), x.dtype))
  std = mk.safe_sqrt(mk.safe_div(jnp.sum(jnp.square(centred)), total))
  return jnp.where(total > 1, std, jnp.zeros((), x.dtype))


def chi2_self_normalised(log_w: jax.Array, m: jax.Array) -> jax.Array:
  """χ² of the self-normalised weights, `mean((w − w̄)²) / w̄²` over `m`.

  The plug-in `mean(w²) − 1` assumes `mean(w) = 1`; on a finite batch (or
  under truncation) it does not hold and the plug-in goes negative (verl
  #7242 logs chi2_seq = −0.88). This estimator is the variance of
  `w / w̄`: ≥ 0 exactly (a sum of squares), 0 iff every weight is equal,
  and invariant to a common factor, so the weights are taken as
  `exp(log_w − max log_w)` and cannot overflow. 0 on an empty set.

  Args:
    log_w: log-weights (`r` per token, or `S_i` per row), any shape.
    m: bool mask of the same shape.
  """
  top = jnp.max(jnp.where(m, log_w, -jnp.inf))
  top = jnp.where(jnp.isfinite(top), top, 0)
  w = jnp.where(m, jnp.exp(jnp.where(m, log_w, top) - top), 0)
  total = mk.count(m, w.dtype)
  mean = mk.safe_div(jnp.sum(w), total)
  var = mk.safe_div(jnp.sum(jnp.where(m, jnp.square(w - mean), 0)), total)
  return mk.safe_div(var, jnp.square(mean))


def version_gap_metrics(
  r: jax.Array, m: jax.Array, gap: jax.Array, buckets: int
) -> Metrics:
  """The mismatch metrics split by policy-version gap (async training).

  With `gap = trainer_version − policy_version` per token, bucket g < G−1
  holds the tokens with gap g and bucket G−1 those with gap ≥ G−1. Per
  bucket: `gap<g>/token_fraction` (of the valid tokens), `gap<g>/kl =
  mmean(−r)`, `gap<g>/k3_kl = mmean(exp(r̂) − r̂ − 1)` and
  `gap<g>/chi2_token_sn` (`chi2_self_normalised`), each 0 for an empty
  bucket (D14). Token means: exact over one call's tokens. The trainer
  calls it once per batch in decoupled mode; in bypass mode once per
  micro-batch, and weighs the micro-batches' values by the tokens each is
  a mean over (`correction.gap_metric_weights`), as one call would.

  Args:
    r: `[B, T]` log-ratio; m: bool `[B, T]` statistics mask.
    gap: int `[B, T]` version gap (negative gaps are counted in bucket 0).
    buckets: G, static, ≥ 1.
  """
  if not isinstance(buckets, int) or buckets < 1:
    raise ValueError(f'buckets={buckets!r} is invalid; allowed: an int >= 1')
  dtype = r.dtype
  gap = jnp.clip(jnp.asarray(gap), 0, buckets - 1)
  r_hat = jnp.clip(r, -_EXP_CAP, _EXP_CAP)
  k3 = jnp.exp(r_hat) - r_hat - 1
  total = mk.count(m, dtype)
  out: Metrics = {}
  for g in range(buckets):
    sel = m & (gap == g)
    out[f'gap{g}/token_fraction'] = mk.safe_div(mk.count(sel, dtype), total)
    out[f'gap{g}/kl'] = mk.masked_mean(-r, sel)
    out[f'gap{g}/k3_kl'] = mk.masked_mean(k3, sel)
    out[f'gap{g}/chi2_token_sn'] = chi2_self_normalised(r, sel)
  return out


def version_gap_counts(m: jax.Array, gap: jax.Array, buckets: int) -> Metrics:
  """The token count each `version_gap_metrics` value is a mean over (same
  keys): all of `m`'s for `gap<g>/token_fraction`, bucket g's for the
  others. A caller that computes the metrics on parts of a batch weighs
  each part's value by them to get the whole batch's."""
  dtype = jnp.float32
  gap = jnp.clip(jnp.asarray(gap), 0, buckets - 1)
  total = mk.count(m, dtype)
  out: Metrics = {}
  for g in range(buckets):
    tokens = mk.count(m & (gap == g), dtype)
    out[f'gap{g}/token_fraction'] = total
    for name in ('kl', 'k3_kl', 'chi2_token_sn'):
      out[f'gap{g}/{name}'] = tokens
  return out


# ------------------------------------------------------------ off-policy


def offpolicy_metrics(
  train_logp: jax.Array,
  rollout_logp: jax.Array,
  r: jax.Array,
  seq_log_ratio: jax.Array,
  m: jax.Array,
  n: jax.Array,
) -> Metrics:
  """The always-emitted mismatch diagnostics (verl).

  Everything that can be is derived from per-row sums, so the whole group
  costs four passes over the batch (on XLA:CPU each `[B, T]` reduction is
  its own pass, and the diagnostics dominate the correction's run time).

  Args:
    train_logp: sanitised `[B, T]` train log-probs (0 outside `m`).
    rollout_logp: sanitised `[B, T]` rollout log-probs.
    r: `[B, T]` log-ratio `train_logp − rollout_logp` (unclamped).
    seq_log_ratio: `[B]` `S_i = Σ_t r·m` (unclamped).
    m: bool `[B, T]` statistics mask.
    n: `[B]` row lengths on `m` (float).

  Returns:
    `training_log_ppl = vmean(−rmean(train_logp))`, `training_ppl =
    vmean(exp(−rmean(train_logp)))` (argument clamped to ±20), the same for
    the rollout, `kl = mmean(−r) = −Σ_i S_i / Σ_i n_i`, `k3_kl =
    mmean(exp(r̂) − r̂ − 1)`, the `log_ppl_diff*` family over `d_i =
    rmean(rollout) − rmean(train)`, `ppl_ratio = vmean(exp(clip(d, ±20)))`,
    `chi2_token = mmean(exp(2r̂)) − 1` and `chi2_seq = vmean(exp(2·clip(S,
    ±20))) − 1` (verl's plug-in estimators, which can be negative), and
    `chi2_token_sn`, `chi2_seq_sn` (`chi2_self_normalised` of r over the
    tokens and of S over the non-empty rows: ≥ 0 always).
  """
  valid = n > 0
  total = jnp.sum(n)
  train_nll = -mk.safe_div(mk.row_sum(train_logp, m), n)
  rollout_nll = -mk.safe_div(mk.row_sum(rollout_logp, m), n)
  d = train_nll - rollout_nll  # rmean(rollout) − rmean(train)
  r_hat = jnp.clip(r, -_EXP_CAP, _EXP_CAP)
  any_token = total > 0
  any_row = jnp.any(valid)
  s_hat = jnp.clip(seq_log_ratio, -_EXP_CAP, _EXP_CAP)
  return {
    'training_log_ppl': mk.rows_mean(train_nll, valid),
    'training_ppl': mk.rows_mean(mk.exp_clamped(train_nll), valid),
    'rollout_log_ppl': mk.rows_mean(rollout_nll, valid),
    'rollout_ppl': mk.rows_mean(mk.exp_clamped(rollout_nll), valid),
    'kl': mk.safe_div(-jnp.sum(seq_log_ratio), total),
    'k3_kl': mk.safe_div(mk.masked_sum(jnp.exp(r_hat) - r_hat - 1, m), total),
    'log_ppl_diff': mk.rows_mean(d, valid),
    'log_ppl_abs_diff': mk.rows_mean(jnp.abs(d), valid),
    'log_ppl_diff_max': mk.rows_max(d, valid),
    'log_ppl_diff_min': mk.rows_min(d, valid),
    'ppl_ratio': mk.rows_mean(mk.exp_clamped(d), valid),
    'chi2_token': _minus_one(
      mk.safe_div(mk.masked_sum(jnp.exp(2 * r_hat), m), total), any_token
    ),
    'chi2_seq': _minus_one(mk.rows_mean(jnp.exp(2 * s_hat), valid), any_row),
    'chi2_token_sn': chi2_self_normalised(r, m),
    'chi2_seq_sn': chi2_self_normalised(seq_log_ratio, valid),
  }


def rejection_metrics(
  n0: jax.Array,
  out_mask: jax.Array,
  nonfinite_train: jax.Array,
  nonfinite_rollout: jax.Array,
  dtype: jnp.dtype,
) -> Metrics:
  """Non-finite counters and the overall rejection rates (new in jaxcorr).

  Args:
    n0: `[B]` row lengths of the input mask `m0` (float).
    out_mask: bool `[B, T]` output mask (a subset of `m0`, so a row lost a
      token exactly when its output length is below `n0`).
    nonfinite_train, nonfinite_rollout: `[B]` per-row counts of input-mask
      tokens with a non-finite value (float).
    dtype: float dtype of the results.
  """
  rows0 = n0 > 0
  n_out = mk.row_count(out_mask, dtype)
  total0 = jnp.sum(n0)
  bad_row = (nonfinite_train + nonfinite_rollout) > 0
  return {
    'nonfinite_rollout_logp_count': jnp.sum(nonfinite_rollout),
    'nonfinite_train_logp_count': jnp.sum(nonfinite_train),
    'nonfinite_seq_fraction': _frac(bad_row, rows0, dtype),
    'rejected_token_fraction': mk.safe_div(total0 - jnp.sum(n_out), total0),
    'rejected_seq_fraction': _frac(n_out < n0, rows0, dtype),
  }


# ---------------------------------------------------------- IS weights


def is_metrics(
  raw: jax.Array,
  w: jax.Array,
  seq_log_weight: jax.Array | None,
  m: jax.Array,
  n: jax.Array,
  *,
  mode: str,
  upper: float,
  lower: float,
) -> Metrics:
  """IS-weight diagnostics (verl, plus `rollout_is_seq_eff_sample_size`).

  Args:
    raw: `[B, T]` masked pre-bound weight.
    w: `[B, T]` weight after truncate/clip/mask, before batch normalisation.
    seq_log_weight: `[B]` `ℓ_i` (`S_i` or `G_i`) for the sequence and
      geometric levels; None at token level.
    m: bool `[B, T]` statistics mask.
    n: `[B]` row lengths on `m` (float).
    mode: the static `is_mode`.
    upper, lower: Cu and Cl (static floats).
  """
  dtype = w.dtype
  valid = n > 0
  total = jnp.sum(n)
  # Bounded weights already lie in [0, Cu], so w' = clip(w, 0, Cu) is w
  # itself, and every token-pooled moment comes from per-row sums (each
  # `[B, T]` reduction is a full pass on XLA:CPU).
  row_w = mk.row_sum(w, m)
  mean_w = mk.safe_div(jnp.sum(row_w), total)
  ess_den = mk.safe_div(
    mk.masked_sum(jnp.square(w / (mean_w + 1e-8)), m), total
  )
  std_w = _pooled_std(w, m, mean_w, total)
  if seq_log_weight is None:
    is_max = mk.masked_max(w, m)
    is_min = mk.masked_min(w, m)
    frac_high = _frac(raw > upper, m, dtype)
    frac_low = _frac(raw < lower, m, dtype)
  else:
    ell = seq_log_weight
    is_max = jnp.exp(jnp.minimum(mk.rows_max(ell, valid), _EXP_CAP))
    is_min = jnp.exp(jnp.minimum(mk.rows_min(ell, valid), _EXP_CAP))
    frac_high = _frac(ell > math.log(upper), valid, dtype)
    frac_low = _frac(ell < math.log(lower), valid, dtype)
  q = mk.safe_div(row_w, n)
  q_raw = mk.safe_div(mk.row_sum(raw, m), n)
  sum_q = mk.masked_sum(q, valid)
  sum_q2 = mk.masked_sum(jnp.square(q), valid)
  out = {
    'rollout_is_mean': mean_w,
    'rollout_is_max': is_max,
    'rollout_is_min': is_min,
    'rollout_is_ratio_fraction_high': frac_high,
    'rollout_is_ratio_fraction_low': frac_low,
    'rollout_is_std': std_w,
    'rollout_is_eff_sample_size': mk.safe_div(jnp.ones((), dtype), ess_den),
    'rollout_is_seq_mean': mk.rows_mean(q, valid),
    'rollout_is_seq_std': mk.rows_std(q, valid),
    'rollout_is_seq_max': mk.rows_max(q, valid),
    'rollout_is_seq_min': mk.rows_min(q, valid),
    'rollout_is_seq_max_deviation': mk.rows_max(jnp.abs(q - 1), valid),
    'rollout_is_seq_fraction_high': _frac(q_raw > upper, valid, dtype),
    'rollout_is_seq_fraction_low': _frac(q_raw < lower, valid, dtype),
    'rollout_is_seq_eff_sample_size': mk.safe_div(
      jnp.square(sum_q), mk.count(valid, dtype) * sum_q2
    ),
  }
  if mode == 'mask':
    out['rollout_is_oob_ratio'] = _frac((raw < lower) | (raw > upper), m, dtype)
  return out


# ----------------------------------------------------------- rejection


def rs_metrics(
  name: str,
  stat: jax.Array,
  seq_stat: jax.Array,
  keep: jax.Array,
  m: jax.Array,
  n: jax.Array,
  *,
  lo: float,
  up: float,
  token_level: bool,
  has_lower: bool,
) -> Metrics:
  """Diagnostics of one rejection criterion, keys `rollout_rs_<name>_*`.

  Args:
    name: criterion name (`token_k1`, `seq_mean_k3`, ...).
    stat: `[B, T]` token statistic (sequence statistics broadcast).
    seq_stat: `[B]` `s_i`: the sequence statistic, or `rmean(stat)` for
      token criteria.
    keep: bool `[B, T]` verdict of this criterion alone.
    m: bool `[B, T]` statistics mask.
    n: `[B]` row lengths `n_i` on `m` (`V = {n_i > 0}`).
    lo, up: bounds on the statistic (k1: `−log(up_ρ)`, `−log(lo_ρ)`; k2/k3:
      0 and `up`).
    token_level: whether the criterion is a `token_*` one.
    has_lower: False for k2/k3, whose `*fraction_low` metrics are 0.
  """
  dtype = stat.dtype
  zero = jnp.zeros((), dtype)
  valid = n > 0
  s = seq_stat
  seq_high = _frac(s > up, valid, dtype)
  seq_low = _frac(s < lo, valid, dtype) if has_lower else zero
  if token_level:
    stat_mean = mk.masked_mean(stat, m)
    stat_max, stat_min = mk.masked_max(stat, m), mk.masked_min(stat, m)
    frac_high = _frac(stat > up, m, dtype)
    frac_low = _frac(stat < lo, m, dtype) if has_lower else zero
    std = _pooled_std(jnp.clip(stat, lo, up), m)
    masked_fraction = _frac(~keep, m, dtype)
    failed_row = jnp.any(m & ~keep, axis=-1)
  else:
    # The statistic and the verdict are constant along each row, so every
    # token-pooled quantity is an n_i-weighted sum over B rows: no pass
    # over the [B, T] batch at all.
    total = jnp.sum(n)
    keep_row = jnp.all(keep[:, :1], axis=-1)  # T = 0 safe
    stat_mean = _row_weighted_mean(s, n, total)
    stat_max, stat_min = mk.rows_max(s, valid), mk.rows_min(s, valid)
    frac_high, frac_low = seq_high, seq_low
    x = jnp.clip(s, lo, up)
    var = _row_weighted_mean(
      jnp.square(x - _row_weighted_mean(x, n, total)), n, total
    )
    std = jnp.where(total > 1, mk.safe_sqrt(var), zero)
    masked_fraction = _row_weighted_mean((~keep_row).astype(dtype), n, total)
    failed_row = valid & ~keep_row
  out = {
    'mean': stat_mean,
    'max': stat_max,
    'min': stat_min,
    'fraction_high': frac_high,
    'fraction_low': frac_low,
    'std': std,
    'seq_mean': mk.rows_mean(s, valid),
    'seq_std': mk.rows_std(s, valid),
    'seq_max': mk.rows_max(s, valid),
    'seq_min': mk.rows_min(s, valid),
    'seq_max_deviation': mk.rows_max(jnp.abs(s), valid),
    'seq_fraction_high': seq_high,
    'masked_fraction': masked_fraction,
    'seq_masked_fraction': _frac(failed_row, valid, dtype),
  }
  if has_lower:  # verl emits no seq_fraction_low for k2/k3
    out['seq_fraction_low'] = seq_low
  return {f'rollout_rs_{name}_{k}': v for k, v in out.items()}


def combined_rs_metrics(
  keep_rs: jax.Array, m: jax.Array, n: jax.Array, *, row_level: bool
) -> Metrics:
  """`rollout_rs_masked_fraction` and `rollout_rs_seq_masked_fraction`.

  `row_level`: every criterion is a sequence one, so `keep_rs` is constant
  along rows and both fractions come from `[B]` vectors.
  """
  dtype = n.dtype
  valid = n > 0
  if row_level:
    keep_row = jnp.all(keep_rs[:, :1], axis=-1)
    masked = _row_weighted_mean((~keep_row).astype(dtype), n, jnp.sum(n))
    failed_row = valid & ~keep_row
  else:
    masked = _frac(~keep_rs, m, dtype)
    failed_row = jnp.any(m & ~keep_rs, axis=-1)
  return {
    'rollout_rs_masked_fraction': masked,
    'rollout_rs_seq_masked_fraction': _frac(failed_row, valid, dtype),
  }


def veto_metrics(
  catastrophic: jax.Array,
  vetoed: jax.Array,
  m: jax.Array,
  valid: jax.Array,
  *,
  high: bool,
  dtype: jnp.dtype,
) -> Metrics:
  """`vmean(veto)` and `mmean(cat)` for one side of the veto.

  Args:
    catastrophic: bool `[B, T]` catastrophic tokens (already `∧ m`).
    vetoed: bool `[B]` vetoed rows.
    m: bool `[B, T]` statistics mask.
    valid: bool `[B]` non-empty rows.
    high: the `veto_high` side (new names) or the `veto_low` side (verl's).
    dtype: float dtype of the results.
  """
  side = '_high' if high else ''
  return {
    f'rollout_is_veto{side}_fraction': _frac(vetoed, valid, dtype),
    f'rollout_is_catastrophic{side}_token_fraction': _frac(
      catastrophic, m, dtype
    ),
  }
