"""Rollout correction: IS weights, rejection, veto, diagnostics.

`docs/math/correction.md` §3–§5. The rollout engine sampled the tokens from μ;
the trainer's policy is π_train (`old_logp` in decoupled mode, `sg(logp)` in
bypass mode). With `r = log π_train − log μ` (so `ρ = exp(r)`):

* **IS** (`is_level`): token `exp(r̂_t)`, sequence `exp(clip(S_i, ±20))` or
  geometric `exp(clip(G_i, ±20))` weights, bounded by truncate / clip / mask,
  optionally renormalised to mean 1;
* **RS** (`rs`): k1/k2/k3 statistics, KPop's Bernoulli KL `bkl` and NeMo's
  multiplicative error `mpe` (`correction_reject`) at token or sequence
  level, each with a keep band, combined with AND;
* **veto**: a row with any token `ρ < τ_lo` (or `ρ > τ_hi`) is dropped;
* rows with a non-finite log-prob at a valid token are dropped and counted;
* diagnostics under `rollout_corr/`, with a key set fixed by the config.

Everything is pure and jit-able; `CorrectionConfig` is a static argument.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcorr.losses import correction_metrics as cm
from jaxcorr.losses import correction_reject
from jaxcorr.losses import masked as mk
from jaxcorr.losses.correction_config import (  # noqa: F401 (re-exported)
  BYPASS_LOSSES,
  IS_LEVELS,
  IS_MODES,
  LEGACY_RS_NAMES,
  MODES,
  RS_CRITERIA,
  CorrectionConfig,
)

METRIC_PREFIX = 'rollout_corr/'
BATCH_NORM_EPS = 1e-8


class Correction(NamedTuple):
  """Output of `rollout_correction` (a pytree).

  Attributes:
    weights: float `[B, T]` IS weights, 0 wherever `mask` is False (1.0 on
      kept tokens when `is_level` is None).
    mask: bool `[B, T]`, a subset of the input mask.
    metrics: `rollout_corr/<name>` → scalar.
  """

  weights: jax.Array
  mask: jax.Array
  metrics: dict[str, jax.Array]


# ------------------------------------------------------------ primitives


def _row_sum_pairwise(x: jax.Array, m: jax.Array) -> jax.Array:
  """`Σ_t x·m` per row (`[B, T]` → `[B]`) by pairwise (tree) summation.

  Same value as `masked.row_sum`, with O(log T) instead of O(T) rounding
  growth: a sequence log-ratio `S_i` enters `exp`, which turns an absolute
  error of a few ulps into a relative error above 1e-6 (verl sums with
  torch's cascaded reduction, close to exact).
  """
  x = jnp.where(m, x, jnp.zeros((), x.dtype))
  t = x.shape[-1]
  width = 1 << max(t - 1, 0).bit_length()
  if width != t:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - t)])
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    x = x[..., :half] + x[..., half:]
  return x[..., 0]


def _row_mean_pairwise(x: jax.Array, m: jax.Array, n: jax.Array) -> jax.Array:
  """`rmean_i(x) = Σ_t x·m / n_i` with the pairwise sum; 0 for empty rows."""
  return mk.safe_div(_row_sum_pairwise(x, m), n)


# ---------------------------------------------------------------- IS


def raw_is_weights(
  r: jax.Array, seq_log_weight: jax.Array | None, m: jax.Array
) -> jax.Array:
  """Masked pre-bound weights `raw`.

  token: `exp(clip(r_t, ±20))`; sequence / geometric: `exp(clip(ℓ_i, ±20))`
  broadcast over the row (clamped after summing), with `ℓ = S` or `G`.

  Args:
    r: `[B, T]` log-ratio.
    seq_log_weight: `[B]` `ℓ_i`, or None for the token level.
    m: bool `[B, T]` statistics mask.
  """
  if seq_log_weight is None:
    raw = mk.exp_clamped(r)
  else:
    raw = jnp.broadcast_to(mk.exp_clamped(seq_log_weight)[:, None], r.shape)
  return jnp.where(m, raw, jnp.zeros((), raw.dtype))


def bound_is_weights(
  raw: jax.Array, m: jax.Array, mode: str, upper: float, lower: float
) -> jax.Array:
  """Applies `is_mode` to `[B, T]` raw weights.

  truncate: `min(raw, Cu)`; clip: `clip(raw, Cl, Cu)`; mask: `raw` where
  `Cl ≤ raw ≤ Cu` else 0 (the mask is not changed). Zero outside `m`.

  Args:
    raw: `[B, T]` masked pre-bound weights.
    m: bool `[B, T]` statistics mask.
    mode: static `is_mode`; upper, lower: Cu and Cl.
  """
  if mode == 'truncate':
    w = jnp.minimum(raw, upper)
  elif mode == 'clip':
    w = jnp.clip(raw, lower, upper)
  else:
    w = jnp.where((raw >= lower) & (raw <= upper), raw, 0)
  return jnp.where(m, w, jnp.zeros((), w.dtype))


def batch_normalize(
  w: jax.Array, m: jax.Array, valid: jax.Array, token_level: bool
) -> tuple[jax.Array, jax.Array]:
  """Rescales `[B, T]` weights to mean 1 (docs/math/correction.md §4.4); returns
  `(w, factor)`.

  `μ = mmean(w)` (token level) or `vmean(rmean(w))` (sequence, geometric),
  on the statistics mask. If `μ > 1e-8`: `w/μ` and factor μ; else w and 1.

  Args:
    w: `[B, T]` bounded weights (0 outside `m`).
    m: bool `[B, T]` statistics mask; valid: bool `[B]` non-empty rows.
    token_level: pool over tokens (True) or average row means (False).
  """
  if token_level:
    mu = mk.masked_mean(w, m)
  else:
    mu = mk.rows_mean(mk.row_mean(w, m), valid)
  ok = mu > BATCH_NORM_EPS
  factor = jnp.where(ok, mu, jnp.ones((), mu.dtype))
  return w / factor, factor


# ---------------------------------------------------------------- RS


def kl_statistics(r: jax.Array) -> dict[str, jax.Array]:
  """Per-token `k1 = −r̂`, `k2 = ½·r̂²`, `k3 = exp(r̂) − 1 − r̂` (`[B, T]`)."""
  r_hat = jnp.clip(r, -mk.SAFETY_BOUND, mk.SAFETY_BOUND)
  return {
    'k1': -r_hat,
    'k2': 0.5 * jnp.square(r_hat),
    'k3': jnp.exp(r_hat) - 1 - r_hat,
  }


def rs_statistic(
  criterion: str, k: jax.Array, m: jax.Array, n: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """`(stat [B, T], s [B])` of one criterion from its token statistic `k`.

  token: `stat = k`, `s = rmean(k)`; seq_sum: `s = Σ_t k·m`; seq_mean:
  `s = rmean(k)`; seq_max: `s = max_t k` over valid tokens (0 when empty).
  Sequence statistics are broadcast: `stat = s[:, None]`.

  Args:
    criterion: an `RS_CRITERIA` name.
    k: `[B, T]` token statistic (k1, k2 or k3).
    m: bool `[B, T]` statistics mask; n: `[B]` row lengths on `m`.
  """
  family = criterion.rsplit('_', 1)[0]
  if family == 'token':
    return k, _row_mean_pairwise(k, m, n)
  if family == 'seq_sum':
    s = _row_sum_pairwise(k, m)
  elif family == 'seq_mean':
    s = _row_mean_pairwise(k, m, n)
  else:
    s = mk.row_max(k, m)
  return jnp.broadcast_to(s[:, None], k.shape), s


def statistic_bounds(
  criterion: str, bounds: tuple[float | None, float]
) -> tuple[float, float]:
  """Bounds on the statistic: k1 `[−log up, −log lo]`; k2/k3 `[0, up]`.

  For k1 the keep rule `−log(up) ≤ −log ρ ≤ −log(lo)` is `lo ≤ ρ ≤ up`
  with ρ = π_train/π_rollout (D1).
  """
  lo, up = bounds
  if criterion.endswith('_k1'):
    return -math.log(up), -math.log(lo)
  return 0.0, up


def rejection(
  r: jax.Array,
  m: jax.Array,
  n: jax.Array,
  cfg: CorrectionConfig,
  bkl: jax.Array | None = None,
  seq_reward: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """AND of every RS criterion: `(keep_rs [B, T], metrics)`.

  k2/k3/bkl/mpe keep `stat ≤ up`; k1 keeps `−log(up) ≤ stat ≤ −log(lo)`.
  An empty row has statistic 0 and is kept (harmless: it has no valid
  token). `seq_mean_mpe` adds NeMo's after-mask statistics and, with
  `seq_reward`, its masked-correct share
  (`correction_reject.seq_error_metrics`).

  Args:
    r: `[B, T]` unclamped log-ratio (0 outside `m`).
    m: bool `[B, T]` statistics mask; n: `[B]` row lengths on `m`.
    cfg: the config (`rs`, `rs_bounds`).
    bkl: `[B, T]` KPop statistic, required by the `*_bkl` criteria.
    seq_reward: optional `[B]` sequence rewards.
  """
  keep_rs = jnp.ones(r.shape, bool)
  metrics: dict[str, jax.Array] = {}
  ks = kl_statistics(r)
  if bkl is not None:
    ks['bkl'] = bkl
  if any(c.endswith('_mpe') for c in cfg.rs):
    ks['mpe'] = correction_reject.mult_prob_error(r)
  for criterion, bounds in zip(cfg.rs, cfg.rs_bounds):
    k1 = criterion.endswith('_k1')
    k = ks[criterion.rsplit('_', 1)[1]]
    stat, s = rs_statistic(criterion, k, m, n)
    lo, up = statistic_bounds(criterion, bounds)
    keep = stat <= up
    if k1:
      keep = keep & (stat >= lo)
    keep_rs = keep_rs & keep
    metrics.update(
      cm.rs_metrics(
        criterion,
        stat,
        s,
        keep,
        m,
        n,
        lo=lo,
        up=up,
        token_level=criterion.startswith('token_'),
        has_lower=k1,
      )
    )
    if criterion == 'seq_mean_mpe':
      extra = correction_reject.seq_error_metrics(s, s <= up, n > 0, seq_reward)
      metrics.update(
        {f'rollout_rs_{criterion}_{name}': v for name, v in extra.items()}
      )
  row_level = not any(c.startswith('token_') for c in cfg.rs)
  metrics.update(cm.combined_rs_metrics(keep_rs, m, n, row_level=row_level))
  return keep_rs, metrics


def veto(
  r: jax.Array, m: jax.Array, tau: float, high: bool
) -> tuple[jax.Array, jax.Array]:
  """Catastrophic tokens and vetoed rows: `(cat [B, T], veto [B])`.

  `cat = m ∧ (r < log τ_lo)` (or `r > log τ_hi`), strict, on the unclamped
  log-ratio; a row is vetoed when any of its tokens is catastrophic.

  Args:
    r: `[B, T]` unclamped log-ratio; m: bool `[B, T]` statistics mask.
    tau: τ_lo or τ_hi; high: which side.
  """
  log_tau = math.log(tau)
  cat = m & ((r > log_tau) if high else (r < log_tau))
  return cat, jnp.any(cat, axis=-1)


# ------------------------------------------------------------- the API


def _check_inputs(train_logp, rollout_logp, mask, cfg, seq_reward) -> None:
  if not isinstance(cfg, CorrectionConfig):
    raise ValueError(
      f'cfg must be a CorrectionConfig, got {type(cfg).__name__}; '
      'to disable the correction pass no config to the objective'
    )
  if rollout_logp is None:
    raise ValueError(
      'rollout_logp is required by the rollout correction (D8), got None; '
      'the rollout engine must report log-probs, or the correction config '
      'must be None'
    )
  if train_logp is None:
    raise ValueError('train_logp is required, got None')
  mk.check_mask(mask)
  mk.check_shapes(
    {'train_logp': train_logp, 'rollout_logp': rollout_logp, 'mask': mask}
  )
  if seq_reward is not None and jnp.shape(seq_reward) != jnp.shape(mask)[:1]:
    raise ValueError(
      f'seq_reward has shape {jnp.shape(seq_reward)}; allowed: one reward '
      f'per row of mask {jnp.shape(mask)}, [B]'
    )


def _finite_rows(train_logp, rollout_logp, m0, dtype):
  """`(m, train, rollout, nonfinite_train, nonfinite_rollout)`: the mask
  without the rows that hold a non-finite log-prob at a valid token
  (docs/math/correction.md §4.2: such a value rejects its whole row), both
  log-probs sanitised with it, and the per-row non-finite counts."""
  nonfinite_train = mk.row_count(m0 & ~jnp.isfinite(train_logp), dtype)
  nonfinite_rollout = mk.row_count(m0 & ~jnp.isfinite(rollout_logp), dtype)
  bad_row = (nonfinite_train + nonfinite_rollout) > 0
  m = m0 & ~bad_row[:, None]
  train = mk.sanitize(train_logp, m, dtype)
  rollout = mk.sanitize(rollout_logp, m, dtype)
  return m, train, rollout, nonfinite_train, nonfinite_rollout


def rollout_correction(
  train_logp: jax.Array,
  rollout_logp: jax.Array,
  mask: jax.Array,
  cfg: CorrectionConfig,
  *,
  version_gap: jax.Array | None = None,
  gap_buckets: int = 4,
  seq_reward: jax.Array | None = None,
) -> Correction:
  """IS weights, rejection mask and diagnostics for one batch
  (docs/math/correction.md §4).

  Args:
    train_logp: float `[B, T]`: `old_logp` (decoupled) or `sg(logp)`
      (bypass).
    rollout_logp: float `[B, T]` log μ from the rollout engine.
    mask: bool `[B, T]` response mask (`m0`).
    cfg: static `CorrectionConfig`.
    version_gap: optional int `[B, T]` trainer version minus the token's
      policy version; adds `correction_metrics.version_gap_metrics`
      (`gap<g>/...`, static key set) to the diagnostics.
    gap_buckets: static number of gap buckets (the last one is open).
    seq_reward: optional float `[B]` sequence rewards; with the
      `seq_mean_mpe` criterion it adds
      `rollout_rs_seq_mean_mpe_masked_correct_fraction` (NeMo-RL's share of
      the dropped rows whose reward is exactly 1). Ignored otherwise.

  Returns:
    `Correction(weights, mask, metrics)`, all under `stop_gradient`.
    `out_mask = m ∧ keep_rs ∧ ¬veto_lo ∧ ¬veto_hi` with `m = m0 ∧ ¬bad`
    (rows with a non-finite log-prob at a valid token removed);
    `weights = where(out_mask, w, 0)` with `w` the bounded, optionally
    normalised IS weight (1.0 when `is_level` is None).

  Raises:
    ValueError: at trace time for a missing `rollout_logp`, a non-bool mask
      or mismatched shapes.
  """
  _check_inputs(train_logp, rollout_logp, mask, cfg, seq_reward)
  dtype = mk.float_dtype(jnp.asarray(train_logp), jnp.asarray(rollout_logp))
  train_logp = jax.lax.stop_gradient(mk.as_float(train_logp, dtype))
  rollout_logp = jax.lax.stop_gradient(mk.as_float(rollout_logp, dtype))
  m0 = jnp.asarray(mask)
  m, train, rollout, nonfinite_train, nonfinite_rollout = _finite_rows(
    train_logp, rollout_logp, m0, dtype
  )
  r = train - rollout
  n = mk.row_count(m, dtype)
  valid = n > 0
  seq_log_ratio = _row_sum_pairwise(r, m)  # S_i, unclamped

  metrics = cm.offpolicy_metrics(train, rollout, r, seq_log_ratio, m, n)
  if version_gap is not None:
    mk.check_shapes({'version_gap': version_gap, 'mask': mask})
    metrics.update(cm.version_gap_metrics(r, m, version_gap, gap_buckets))

  weights = _is_weights(r, seq_log_ratio, m, n, valid, cfg, metrics)
  keep = _keep_mask(
    r, train, rollout, m, n, valid, cfg, metrics, dtype, seq_reward
  )
  out_mask = m & keep
  if weights is None:
    weights = jnp.ones(m.shape, dtype)
  weights = jnp.where(out_mask, weights, jnp.zeros((), dtype))
  metrics.update(
    cm.rejection_metrics(
      mk.row_count(m0, dtype),
      out_mask,
      nonfinite_train,
      nonfinite_rollout,
      dtype,
    )
  )
  metrics = {METRIC_PREFIX + k: v for k, v in sorted(metrics.items())}
  return jax.lax.stop_gradient(Correction(weights, out_mask, metrics))


def gap_metric_weights(
  train_logp: jax.Array,
  rollout_logp: jax.Array,
  mask: jax.Array,
  *,
  version_gap: jax.Array,
  gap_buckets: int,
) -> dict[str, jax.Array]:
  """The token counts the `rollout_corr/gap<g>/` metrics of the same
  `rollout_correction` call are means over
  (`correction_metrics.version_gap_counts`): bypass mode runs the
  correction per micro-batch and weighs each one's values by them."""
  mk.check_shapes({'version_gap': version_gap, 'mask': mask})
  dtype = mk.float_dtype(jnp.asarray(train_logp), jnp.asarray(rollout_logp))
  train_logp = mk.as_float(train_logp, dtype)
  rollout_logp = mk.as_float(rollout_logp, dtype)
  m = _finite_rows(train_logp, rollout_logp, jnp.asarray(mask), dtype)[0]
  counts = cm.version_gap_counts(m, version_gap, gap_buckets)
  return jax.lax.stop_gradient(
    {METRIC_PREFIX + k: v for k, v in counts.items()}
  )


def _is_weights(r, seq_log_ratio, m, n, valid, cfg, metrics):
  """The bounded (and optionally batch-normalised) IS weights of
  `cfg.is_level`, None when it is None; adds the IS metrics to `metrics`
  (docs/math/correction.md §4)."""
  if cfg.is_level is None:
    return None
  ell = {
    'token': None,
    'sequence': seq_log_ratio,
    'geometric': mk.safe_div(seq_log_ratio, n),  # G_i
  }[cfg.is_level]
  raw = raw_is_weights(r, ell, m)
  w = bound_is_weights(raw, m, cfg.is_mode, cfg.is_upper, cfg.lower)
  metrics.update(
    cm.is_metrics(
      raw,
      w,
      ell,
      m,
      n,
      mode=cfg.is_mode,
      upper=cfg.is_upper,
      lower=cfg.lower,
    )
  )
  weights = w
  if cfg.is_batch_normalize:
    weights, factor = batch_normalize(
      w, m, valid, token_level=cfg.is_level == 'token'
    )
    metrics['rollout_is_batch_norm_factor'] = factor
  return weights


def _keep_mask(r, train, rollout, m, n, valid, cfg, metrics, dtype, reward):
  """The rejection-sampling and veto keep mask `[B, T]`; adds their metrics
  to `metrics` (docs/math/correction.md §4)."""
  keep = jnp.ones(m.shape, bool)
  if cfg.rs:
    bkl = None
    if any(c.endswith('_bkl') for c in cfg.rs):
      bkl = correction_reject.kpop_statistic(train, rollout, m)
    keep_rs, rs_metrics = rejection(r, m, n, cfg, bkl, reward)
    keep = keep & keep_rs
    metrics.update(rs_metrics)
  for tau, high in ((cfg.veto_low, False), (cfg.veto_high, True)):
    if tau is not None:
      cat, vetoed = veto(r, m, tau, high)
      keep = keep & ~vetoed[:, None]
      metrics.update(
        cm.veto_metrics(cat, vetoed, m, valid, high=high, dtype=dtype)
      )
  return keep
