"""Diagnostics that cannot mislead: a non-negative χ², clip fractions from
the raw weights, and the mismatch metrics split by policy-version gap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcorr.losses import correction as corr
from jaxcorr.losses.correction import metrics as cm

P = corr.METRIC_PREFIX


def _batch(seed=0, b=16, t=24, shift=0.0, scale=0.5):
  rng = np.random.default_rng(seed)
  rollout = -rng.uniform(0.05, 3.0, (b, t)).astype(np.float32)
  train = (rollout + shift + scale * rng.normal(size=(b, t))).astype(np.float32)
  lengths = rng.integers(1, t + 1, b)
  lengths[3] = 0  # an empty row
  mask = np.arange(t) < lengths[:, None]
  return train, rollout, mask


def _sn_chi2(log_w):
  w = np.exp(log_w.astype(np.float64) - log_w.max())
  return np.mean((w - w.mean()) ** 2) / w.mean() ** 2


def test_plugin_chi2_goes_negative_self_normalised_does_not():
  """π_train puts less mass than μ on the sampled tokens (verl#7242's
  situation): E_μ[ρ] < 1 on the batch, so the plug-in E[ρ²] − 1 is
  negative, which no χ² divergence can be."""
  train, rollout, mask = _batch(shift=-0.3, scale=0.3)
  out = corr.rollout_correction(
    jnp.asarray(train), jnp.asarray(rollout), jnp.asarray(mask),
    corr.CorrectionConfig(),
  )  # fmt: skip
  met = {k.removeprefix(P): float(v) for k, v in out.metrics.items()}
  assert met['chi2_seq'] < -0.5 and met['chi2_token'] < 0
  assert met['chi2_seq_sn'] >= 0 and met['chi2_token_sn'] >= 0
  r = (train - rollout)[mask]
  s = np.where(mask, train - rollout, 0).sum(-1)[mask.any(-1)]
  np.testing.assert_allclose(met['chi2_token_sn'], _sn_chi2(r), rtol=1e-4)
  np.testing.assert_allclose(met['chi2_seq_sn'], _sn_chi2(s), rtol=1e-4)
  print(
    f'\nchi2_seq plug-in {met["chi2_seq"]:.3f} vs self-normalised '
    f'{met["chi2_seq_sn"]:.3f}; chi2_token {met["chi2_token"]:.3f} vs '
    f'{met["chi2_token_sn"]:.3f}'
  )


def test_self_normalised_chi2_properties():
  rng = np.random.default_rng(1)
  log_w = jnp.asarray(rng.normal(size=50) * 3, jnp.float32)
  m = jnp.asarray(rng.random(50) < 0.7)
  base = float(cm.chi2_self_normalised(log_w, m))
  # Invariant to a common factor, even one that overflows exp().
  np.testing.assert_allclose(
    cm.chi2_self_normalised(log_w + 500.0, m), base, rtol=1e-5
  )
  assert (
    float(cm.chi2_self_normalised(jnp.full(5, 3.0), jnp.ones(5, bool))) == 0
  )
  assert float(cm.chi2_self_normalised(log_w, jnp.zeros(50, bool))) == 0
  # Huge spreads: finite and ≥ 0.
  wide = jnp.asarray([-1e4, 0.0, 1e4, 50.0])
  v = float(cm.chi2_self_normalised(wide, jnp.ones(4, bool)))
  assert np.isfinite(v) and v >= 0


def test_clip_fractions_come_from_raw_weights():
  """Truncated weights never exceed the cap, so a fraction computed from
  them would read 0; jaxcorr counts the raw weights above the cap."""
  train, rollout, mask = _batch(seed=2, scale=1.0)
  cfg = corr.CorrectionConfig(is_level='token', is_upper=1.5)
  out = corr.rollout_correction(
    jnp.asarray(train), jnp.asarray(rollout), jnp.asarray(mask), cfg
  )
  raw = np.exp(train - rollout)
  assert float(jnp.max(out.weights)) <= 1.5
  np.testing.assert_allclose(
    out.metrics[P + 'rollout_is_ratio_fraction_high'],
    (raw[mask] > 1.5).mean(),
    rtol=1e-6,
  )
  assert float(out.metrics[P + 'rollout_is_ratio_fraction_high']) > 0.05
  np.testing.assert_allclose(
    out.metrics[P + 'rollout_is_ratio_fraction_low'],
    (raw[mask] < 1 / 1.5).mean(),
    rtol=1e-6,
  )


def test_version_gap_split():
  train, rollout, mask = _batch(seed=3)
  rng = np.random.default_rng(3)
  gap = rng.integers(0, 6, mask.shape).astype(np.int32)
  # Older tokens drift further: scale the log-ratio with the gap.
  r = (train - rollout) * (1 + gap)
  train = (rollout + r).astype(np.float32)
  run = jax.jit(
    lambda a, b, m, g: corr.rollout_correction(
      a, b, m, corr.CorrectionConfig(), version_gap=g, gap_buckets=3
    )
  )
  out = run(train, rollout, mask, gap)
  met = {k.removeprefix(P): float(v) for k, v in out.metrics.items()}
  fr = [met[f'gap{g}/token_fraction'] for g in range(3)]
  np.testing.assert_allclose(sum(fr), 1.0, rtol=1e-6)
  bucket = np.minimum(gap, 2)
  for g in range(3):
    sel = mask & (bucket == g)
    np.testing.assert_allclose(fr[g], sel.sum() / mask.sum(), rtol=1e-6)
    np.testing.assert_allclose(met[f'gap{g}/kl'], -r[sel].mean(), rtol=1e-5)
    np.testing.assert_allclose(
      met[f'gap{g}/chi2_token_sn'], _sn_chi2(r[sel]), rtol=1e-4
    )
  assert met['gap0/kl'] != met['gap2/kl']
  # Without versions the key set is unchanged (no gap metrics).
  plain = corr.rollout_correction(train, rollout, mask, corr.CorrectionConfig())
  assert not any('/gap' in k for k in plain.metrics)
