"""The log-prob family: `ℓ = −c·A·logp` with a stop-gradient coefficient c
(docs/math/losses.md §4.3).

The gradient reaches π_θ only through logp, scaled by a constant c that no
trust region clips away: REINFORCE (`gpg`, `reinforce`), with a squared
log-ratio penalty (`dro`), with a banded rollout IS weight (`rollout_is`) or
prime-rl's μ mask (`prime`), with CISPO's clipped IS weight against π_old
(`cispo`) or against the rollout policy μ (`cispo_rollout`), and with TOPR's
per-row taper of negative samples (`topr`).

Each function maps sanitised `LossInputs` and the typed `PolicyKnobs` to the
per-token loss ℓ `[B, T]` and its metrics; see
`jaxcorr.losses.policy.inputs`. Notation: δ = logp − old_logp,
r = logp − rollout_logp, ρ = exp(clip(δ, ±20)), ρ_μ = exp(clip(r, ±20)),
sg = stop_gradient.

References for the stale-data losses (goldens in `tests/golden/frontier/`,
divergences in docs/correction.md §4): SkyRL #1859
(`cispo_anchor='rollout'`) and verl PR #6986 (TOPR).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcorr.losses import masked
from jaxcorr.losses.policy.inputs import (
  LossInputs,
  Metrics,
  PolicyKnobs,
  clamp,
  clip_metrics,
  mmean,
  old_delta,
  weighted,
  zero,
)

sg = jax.lax.stop_gradient

TOPR_LOG_RATIO_CAP = 10.0


def gpg(x: LossInputs, k: PolicyKnobs) -> tuple[jax.Array, Metrics]:
  """GPG (verl): `ℓ = −A·logp·w`. Reads no other log-prob; no metrics."""
  del k
  return weighted(-x.adv * x.logp, x), {}


def reinforce(x: LossInputs, k: PolicyKnobs) -> tuple[jax.Array, Metrics]:
  """REINFORCE (verl bypass `reinforce`): `ℓ = −A·logp·w`.

  Only metric: `ppo_kl = mmean(old_logp − logp)`, emitted only when
  `old_logp` is given (in bypass mode it is μ).
  """
  del k
  metrics = {}
  if x.old_logp is not None:
    metrics['actor/ppo_kl'] = mmean(-old_delta(x), x)
  return weighted(-x.adv * x.logp, x), metrics


def dro(x: LossInputs, k: PolicyKnobs) -> tuple[jax.Array, Metrics]:
  """DRO (verl): `ℓ = −(logp·A − ½·dro_beta·δ²)·w` with unclamped δ.

  Only metric: `ppo_kl = mmean(−δ)`.
  """
  d = old_delta(x)
  loss = -(x.logp * x.adv - 0.5 * k.dro_beta * jnp.square(d))
  return weighted(loss, x), {'actor/ppo_kl': mmean(-d, x)}


def rollout_is(x: LossInputs, k: PolicyKnobs) -> tuple[jax.Array, Metrics]:
  """Rollout IS with a hard band (SkyRL rollout_is); takes no IS weights.

  `c = ρ_μ` if `1−ε_l < ρ_μ < 1+ε_h` (strict) else 0; `ℓ = −sg(c)·A·logp`.
  Metrics: `pg_clipfrac = mmean(c = 0)`, `ppo_kl = mmean(rollout_logp −
  logp)`.
  """
  r = x.logp - x.rollout_logp
  rho = masked.exp_clamped(r)
  inside = (rho > 1 - k.clip_ratio_low) & (rho < 1 + k.clip_ratio_high)
  c = jnp.where(inside, rho, 0)
  metrics = {
    'actor/pg_clipfrac': mmean(c == 0, x),
    'actor/ppo_kl': mmean(-r, x),
  }
  return -sg(c) * x.adv * x.logp, metrics


def prime(x: LossInputs, k: PolicyKnobs) -> tuple[jax.Array, Metrics]:
  """prime-rl's default loss: DPPO-style μ mask plus a squared log-ratio.

  `pd = sg(exp(logp) − exp(rollout_logp))`;
  `masked = A > 0 ? pd > prime_mask_high : pd < −prime_mask_low`;
  `keep = m ∧ ¬masked`;
  `ℓ = −keep·prime_adv_tau·A·ρ_μ + prime_kl_tau·r²` (r unclamped; the squared
  term covers every token of m). Takes no IS weights.
  Metrics: `prime_is_masked = mmean(masked)`,
  `prime_is_masked_low = mmean(A < 0 ∧ pd < −low)`,
  `prime_is_masked_high = mmean(A > 0 ∧ pd > high)`, and the mean of
  `ρ_μ − log ρ_μ − 1` over the masked (`prime_masked_mismatch_kl`) and the
  kept (`prime_unmasked_mismatch_kl`) tokens, 0 for an empty set.
  """
  low, high = k.prime_mask_low, k.prime_mask_high
  r = x.logp - x.rollout_logp
  rh = clamp(r)
  rho = jnp.exp(rh)
  pd = jnp.exp(sg(x.logp)) - jnp.exp(x.rollout_logp)
  pos, neg = x.adv > 0, x.adv < 0
  is_low, is_high = pd < -low, pd > high
  hit = jnp.where(pos, is_high, is_low)
  keep = x.mask & ~hit
  pg = jnp.where(keep, -k.prime_adv_tau * x.adv * rho, 0)
  loss = pg + k.prime_kl_tau * jnp.square(r)
  mkl = sg(rho - rh - 1)
  metrics = {
    'actor/prime_is_masked': mmean(hit, x),
    'actor/prime_is_masked_low': mmean(neg & is_low, x),
    'actor/prime_is_masked_high': mmean(pos & is_high, x),
    'actor/prime_masked_mismatch_kl': masked.masked_mean(mkl, hit & x.mask),
    'actor/prime_unmasked_mismatch_kl': masked.masked_mean(mkl, keep),
  }
  return loss, metrics


# ---------------------------------------------------------------- CISPO


def _cispo(x: LossInputs, k: PolicyKnobs, anchor: jax.Array):
  """`(ℓ, ρ ≠ clip(ρ), ratio metrics)` of CISPO against `anchor`."""
  lo, hi = k.cispo_bounds
  rho = masked.exp_clamped(sg(x.logp) - anchor)
  clamped = jnp.clip(rho, 1 - lo, 1 + hi)
  loss = -sg(clamped) * x.adv * x.logp
  metrics = {
    'actor/cispo_ratio_mean': mmean(rho, x),
    'actor/cispo_ratio_clamped_mean': mmean(clamped, x),
    'actor/cispo_ratio_max': masked.masked_max(rho, x.mask),
    'actor/cispo_ratio_min': masked.masked_min(rho, x.mask),
  }
  return loss, mmean(rho != clamped, x), metrics


def cispo(x: LossInputs, k: PolicyKnobs) -> tuple[jax.Array, Metrics]:
  """CISPO (verl, SkyRL, slime): clipped, stop-gradient IS weight on logp.

  κ_l, κ_h = `cispo_clip_low/high`, or ε_l, ε_h when None;
  `ℓ = −sg(clip(ρ, 1−κ_l, 1+κ_h))·A·logp·w`.
  Metrics: `pg_clipfrac = mmean(ρ ≠ clip(ρ))`, `pg_clipfrac_lower = 0`,
  `ppo_kl = mmean(−δ̂)`, and `cispo_ratio_{mean,clamped_mean,max,min}` of ρ
  and its clip over the valid tokens (max and min 0 for an empty mask), as
  SkyRL logs them.
  """
  loss, clipfrac, ratio = _cispo(x, k, x.old_logp)
  metrics = {**clip_metrics(x, old_delta(x), clipfrac, zero(x)), **ratio}
  return weighted(loss, x), metrics


def cispo_rollout(x: LossInputs, k: PolicyKnobs) -> tuple[jax.Array, Metrics]:
  """CISPO with its ratio taken against the rollout policy μ (SkyRL #1859).

  `ℓ = −sg(clip(ρ_μ, 1−κ_l, 1+κ_h))·A·logp` with κ as in `cispo` (SkyRL's
  defaults are κ_l = 1, κ_h = 4: ρ_μ in [0, 5]). The ratio already divides
  by μ, so no IS weights are taken (SkyRL refuses TIS too).
  Metrics: `pg_clipfrac` (ρ_μ ≠ its clip) and
  `cispo_ratio_{mean,clamped_mean,max,min}` as `cispo`'s, of ρ_μ.
  """
  loss, clipfrac, ratio = _cispo(x, k, x.rollout_logp)
  return loss, {'actor/pg_clipfrac': clipfrac, **ratio}


# ----------------------------------------------------------------- TOPR


def topr(x: LossInputs, k: PolicyKnobs) -> tuple[jax.Array, Metrics]:
  """TOPR, tapered off-policy REINFORCE (verl PR #6986).

  Per row, `n_i = max(Σ_t m, 1)`, `s_i = Σ_t δ·m / n_i`,
  `ρ̄_i = exp(min(s_i, 10))`, `Ā_i = Σ_t A·m / n_i`; `t_i = 1` if `Ā_i ≥ 0`
  else `clip(ρ̄_i, topr_negative_ratio_lower, topr_negative_ratio_upper)`;
  `ℓ = −A·logp·sg(t_i)·w`. Natural aggregation `seq_mean_token_mean`;
  unlike verl, an explicit `agg` is honoured (D22 in docs/correction.md).
  Metrics: `ppo_kl`, `topr_negative_seq_frac` and `topr_taper_weight_mean`,
  both over the non-empty rows (D4; verl counts empty rows, with Ā = 0 and
  weight 1).
  """
  dtype = x.logp.dtype
  d = sg(x.logp) - x.old_logp
  count = masked.row_count(x.mask, dtype)
  n = jnp.maximum(count, 1)
  s = jnp.sum(d, axis=-1) / n
  rho = jnp.exp(jnp.minimum(s, TOPR_LOG_RATIO_CAP))
  a_bar = jnp.sum(x.adv, axis=-1) / n
  negative = a_bar < 0
  low, high = k.topr_negative_ratio_lower, k.topr_negative_ratio_upper
  taper = jnp.where(negative, jnp.clip(rho, low, high), 1)
  loss = -x.adv * x.logp * sg(taper)[:, None]
  valid = count > 0
  metrics = {
    'actor/ppo_kl': mmean(-clamp(d), x),
    'actor/topr_negative_seq_frac': masked.rows_mean(
      negative.astype(dtype), valid
    ),
    'actor/topr_taper_weight_mean': masked.rows_mean(taper, valid),
  }
  return weighted(loss, x), metrics
