"""Importance-sampling weights of the rollout correction
(docs/math/correction.md §4.3–§4.4).

With `r = log π_train − log μ` the raw weight is `exp(r̂_t)` per token, or
`exp(clip(ℓ_i, ±20))` per row with `ℓ_i = S_i = Σ_t r·m` (sequence) or
`G_i = S_i / n_i` (geometric); `bound_is_weights` truncates, clips or masks
it, and `batch_normalize` optionally rescales it to mean 1. `is_weights`
applies all three as a `CorrectionConfig` says.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxcorr.losses import masked as mk
from jaxcorr.losses.correction import metrics as cm

if TYPE_CHECKING:
  from jaxcorr.losses.correction.config import CorrectionConfig

BATCH_NORM_EPS = 1e-8


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
  """Rescales `[B, T]` weights to mean 1 (docs/math/correction.md §4.4);
  returns `(w, factor)`.

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


def is_weights(
  r: jax.Array,
  seq_log_ratio: jax.Array,
  m: jax.Array,
  n: jax.Array,
  cfg: CorrectionConfig,
  metrics: dict[str, jax.Array],
) -> jax.Array | None:
  """The bounded (and optionally batch-normalised) IS weights of
  `cfg.is_level`, None when it is None; adds the IS metrics to `metrics`.

  Args:
    r: `[B, T]` unclamped log-ratio (0 outside `m`).
    seq_log_ratio: `[B]` `S_i = Σ_t r·m`.
    m: bool `[B, T]` statistics mask; n: `[B]` row lengths on `m`.
    cfg: the config (`is_level`, `is_mode`, bounds, `is_batch_normalize`).
    metrics: the diagnostics, updated in place.
  """
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
      raw, w, ell, m, n, mode=cfg.is_mode, upper=cfg.is_upper, lower=cfg.lower
    )
  )
  if not cfg.is_batch_normalize:
    return w
  w, factor = batch_normalize(w, m, n > 0, token_level=cfg.is_level == 'token')
  metrics['rollout_is_batch_norm_factor'] = factor
  return w
