"""`rollout_correction`: the entry that applies the rollout correction
(docs/math/correction.md §3–§5).

The rollout engine sampled the tokens from μ; the trainer's policy is
π_train (`old_logp` in decoupled mode, `sg(logp)` in bypass mode). With
`r = log π_train − log μ` (so `ρ = exp(r)`), one call

* drops the rows with a non-finite log-prob at a valid token, and counts
  them (docs/math/correction.md §4.2);
* computes the IS weights of `is_level` (`jaxcorr.losses.correction.weights`);
* ANDs the RS criteria and the vetoes (`jaxcorr.losses.correction.rejection`);
* logs the diagnostics under `rollout_corr/`, with a key set fixed by the
  config (`jaxcorr.losses.correction.metrics`).

This module composes the three; they do not import it. Everything is pure
and jit-able; `CorrectionConfig` is a static argument.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcorr.losses import masked as mk
from jaxcorr.losses.correction import metrics as cm
from jaxcorr.losses.correction import rejection, weights
from jaxcorr.losses.correction.config import CorrectionConfig

METRIC_PREFIX = 'rollout_corr/'
"""The prefix of every diagnostic of `rollout_correction`."""


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
      policy version; adds `metrics.version_gap_metrics`
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
  seq_log_ratio = mk.row_sum_pairwise(r, m)  # S_i, unclamped

  metrics = cm.offpolicy_metrics(train, rollout, r, seq_log_ratio, m, n)
  if version_gap is not None:
    mk.check_shapes({'version_gap': version_gap, 'mask': mask})
    metrics.update(cm.version_gap_metrics(r, m, version_gap, gap_buckets))

  w = weights.is_weights(r, seq_log_ratio, m, n, cfg, metrics)
  sample = rejection.Sample(r, train, rollout, m)
  criteria = tuple(zip(cfg.rs, cfg.rs_bounds))
  vetoes = (cfg.veto_low, cfg.veto_high)
  keep = rejection.keep_mask(sample, n, criteria, vetoes, metrics, seq_reward)
  out_mask = m & keep
  if w is None:
    w = jnp.ones(m.shape, dtype)
  w = jnp.where(out_mask, w, jnp.zeros((), dtype))
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
  return jax.lax.stop_gradient(Correction(w, out_mask, metrics))


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
  (`metrics.version_gap_counts`): bypass mode runs the
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
