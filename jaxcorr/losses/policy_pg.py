"""Log-prob-weighted policy losses: the REINFORCE family
(docs/math/losses.md §4.3).

`gpg`, `reinforce`, `dro` and the two μ-anchored losses `rollout_is` and
`prime`. Each function maps sanitised `LossInputs` and the typed
`PolicyKnobs` to the per-token loss ℓ `[B, T]` and its metrics; see
`policy_base`. Notation:
r = logp − rollout_logp, ρ_μ = exp(clip(r, ±20)), sg = stop_gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcorr.losses import masked
from jaxcorr.losses.policy_base import (
  LossInputs,
  Metrics,
  PolicyKnobs,
  clamp,
  mmean,
  old_delta,
  weighted,
)

sg = jax.lax.stop_gradient


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
