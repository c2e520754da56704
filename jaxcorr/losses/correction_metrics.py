"""Diagnostics of the rollout correction (spec correction.md §5).

Every function here returns a dict of scalars *without* the `rollout_corr/`
prefix; `correction.rollout_correction` adds it. All statistics use the
statistics mask `m` (valid and finite rows, before any rejection), and every
reduction returns 0 on an empty set (D14). Sequence statistics average over
the non-empty rows `V` only (D4).

Notation (as in the spec): `r = log ρ` the unclamped log-ratio `[B, T]`,
`r̂ = clip(r, ±20)`, `S_i = Σ_t r·m`, `q_i = rmean(w)_i`, `valid` marks the
rows of `V`.
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


def _minus_one(x: jax.Array, nonempty: jax.Array) -> jax.Array:
  """`x − 1`, but 0 on an empty set (where `x` is the empty mean 0)."""
  return jnp.where(nonempty, x - 1, jnp.zeros((), x.dtype))


def _pooled_std(x: jax.Array, m: jax.Array) -> jax.Array:
  """`sqrt(max(mmean(x²) − mmean(x)², 0))` if `Σm > 1`, else 0 (verl).

  Evaluated in the two-pass form `mmean((x − mmean(x))²)`, the same
  quantity without the cancellation of the one-pass form (verl's float32
  one-pass value is off by ~4e-6 relative; README "dtypes and tolerances").
  """
  centred = jnp.where(m, x - mk.masked_mean(x, m), jnp.zeros((), x.dtype))
  std = mk.safe_sqrt(mk.masked_mean(jnp.square(centred), m))
  return jnp.where(mk.count(m, x.dtype) > 1, std, jnp.zeros((), x.dtype))


# ------------------------------------------------------------ off-policy


def offpolicy_metrics(
  train_logp: jax.Array,
  rollout_logp: jax.Array,
  r: jax.Array,
  seq_log_ratio: jax.Array,
  m: jax.Array,
  valid: jax.Array,
) -> Metrics:
  """The always-emitted mismatch diagnostics (verl).

  Args:
    train_logp: sanitised `[B, T]` train log-probs (0 outside `m`).
    rollout_logp: sanitised `[B, T]` rollout log-probs.
    r: `[B, T]` log-ratio `train_logp − rollout_logp` (unclamped).
    seq_log_ratio: `[B]` `S_i = Σ_t r·m` (unclamped).
    m: bool `[B, T]` statistics mask.
    valid: bool `[B]` non-empty rows.

  Returns:
    `training_log_ppl = vmean(−rmean(train_logp))`, `training_ppl =
    vmean(exp(−rmean(train_logp)))` (argument clamped to ±20), the same for
    the rollout, `kl = mmean(−r)`, `k3_kl = mmean(exp(r̂) − r̂ − 1)`, the
    `log_ppl_diff*` family over `d_i = rmean(rollout) − rmean(train)`,
    `ppl_ratio = vmean(exp(clip(d, ±20)))`, `chi2_token = mmean(exp(2r̂)) − 1`
    and `chi2_seq = vmean(exp(2·clip(S, ±20))) − 1`.
  """
  train_nll = -mk.row_mean(train_logp, m)
  rollout_nll = -mk.row_mean(rollout_logp, m)
  d = train_nll - rollout_nll  # rmean(rollout) − rmean(train)
  r_hat = jnp.clip(r, -_EXP_CAP, _EXP_CAP)
  any_token = jnp.any(m)
  any_row = jnp.any(valid)
  s_hat = jnp.clip(seq_log_ratio, -_EXP_CAP, _EXP_CAP)
  return {
    'training_log_ppl': mk.rows_mean(train_nll, valid),
    'training_ppl': mk.rows_mean(mk.exp_clamped(train_nll), valid),
    'rollout_log_ppl': mk.rows_mean(rollout_nll, valid),
    'rollout_ppl': mk.rows_mean(mk.exp_clamped(rollout_nll), valid),
    'kl': mk.masked_mean(-r, m),
    'k3_kl': mk.masked_mean(jnp.exp(r_hat) - r_hat - 1, m),
    'log_ppl_diff': mk.rows_mean(d, valid),
    'log_ppl_abs_diff': mk.rows_mean(jnp.abs(d), valid),
    'log_ppl_diff_max': mk.rows_max(d, valid),
    'log_ppl_diff_min': mk.rows_min(d, valid),
    'ppl_ratio': mk.rows_mean(mk.exp_clamped(d), valid),
    'chi2_token': _minus_one(mk.masked_mean(jnp.exp(2 * r_hat), m), any_token),
    'chi2_seq': _minus_one(mk.rows_mean(jnp.exp(2 * s_hat), valid), any_row),
  }


def rejection_metrics(
  m0: jax.Array,
  out_mask: jax.Array,
  nonfinite_train: jax.Array,
  nonfinite_rollout: jax.Array,
  bad_row: jax.Array,
  dtype: jnp.dtype,
) -> Metrics:
  """Non-finite counters and the overall rejection rates (new in jaxcorr).

  Args:
    m0: bool `[B, T]` input mask.
    out_mask: bool `[B, T]` output mask.
    nonfinite_train, nonfinite_rollout: bool `[B, T]`, `m0 ∧ ¬isfinite(·)`.
    bad_row: bool `[B]` rows with a non-finite value at a valid token.
    dtype: float dtype of the results.
  """
  rows0 = jnp.any(m0, axis=-1)
  lost_row = jnp.any(m0 & ~out_mask, axis=-1)
  n0 = mk.count(m0, dtype)
  return {
    'nonfinite_rollout_logp_count': mk.count(nonfinite_rollout, dtype),
    'nonfinite_train_logp_count': mk.count(nonfinite_train, dtype),
    'nonfinite_seq_fraction': _frac(bad_row, rows0, dtype),
    'rejected_token_fraction': mk.safe_div(n0 - mk.count(out_mask, dtype), n0),
    'rejected_seq_fraction': _frac(lost_row, rows0, dtype),
  }


# ---------------------------------------------------------- IS weights


def is_metrics(
  raw: jax.Array,
  w: jax.Array,
  seq_log_weight: jax.Array | None,
  m: jax.Array,
  valid: jax.Array,
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
    valid: bool `[B]` non-empty rows.
    mode: the static `is_mode`.
    upper, lower: Cu and Cl (static floats).
  """
  dtype = w.dtype
  w_cap = jnp.clip(w, 0, upper)  # w' = clip(w, 0, Cu)
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
  mean_cap = mk.masked_mean(w_cap, m)
  ess_den = mk.masked_mean(jnp.square(w_cap / (mean_cap + 1e-8)), m)
  q = mk.row_mean(w, m)
  q_raw = mk.row_mean(raw, m)
  sum_q = mk.masked_sum(q, valid)
  sum_q2 = mk.masked_sum(jnp.square(q), valid)
  out = {
    'rollout_is_mean': mk.masked_mean(w, m),
    'rollout_is_max': is_max,
    'rollout_is_min': is_min,
    'rollout_is_ratio_fraction_high': frac_high,
    'rollout_is_ratio_fraction_low': frac_low,
    'rollout_is_std': _pooled_std(w_cap, m),
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
  else:
    # mmean of the broadcast statistic, as Σ_i n_i·s_i / Σ_i n_i (B terms).
    stat_mean = mk.safe_div(mk.masked_sum(n * s, valid), jnp.sum(n))
    stat_max, stat_min = mk.rows_max(s, valid), mk.rows_min(s, valid)
    frac_high, frac_low = seq_high, seq_low
  failed_row = jnp.any(m & ~keep, axis=-1)
  out = {
    'mean': stat_mean,
    'max': stat_max,
    'min': stat_min,
    'fraction_high': frac_high,
    'fraction_low': frac_low,
    'std': _pooled_std(jnp.clip(stat, lo, up), m),
    'seq_mean': mk.rows_mean(s, valid),
    'seq_std': mk.rows_std(s, valid),
    'seq_max': mk.rows_max(s, valid),
    'seq_min': mk.rows_min(s, valid),
    'seq_max_deviation': mk.rows_max(jnp.abs(s), valid),
    'seq_fraction_high': seq_high,
    'masked_fraction': _frac(~keep, m, dtype),
    'seq_masked_fraction': _frac(failed_row, valid, dtype),
  }
  if has_lower:  # verl emits no seq_fraction_low for k2/k3
    out['seq_fraction_low'] = seq_low
  return {f'rollout_rs_{name}_{k}': v for k, v in out.items()}


def combined_rs_metrics(
  keep_rs: jax.Array, m: jax.Array, valid: jax.Array, dtype: jnp.dtype
) -> Metrics:
  """`rollout_rs_masked_fraction` and `rollout_rs_seq_masked_fraction`."""
  failed_row = jnp.any(m & ~keep_rs, axis=-1)
  return {
    'rollout_rs_masked_fraction': _frac(~keep_rs, m, dtype),
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
