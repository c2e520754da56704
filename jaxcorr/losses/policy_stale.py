"""Policy losses for stale and rollout-anchored data (the 2026 frontier).

Each estimator is a pure function of `[B, T]` arrays with typed keyword knobs
that returns `(per_token ℓ [B, T], metrics)`; the registry in
`jaxcorr.losses.policy` aggregates ℓ. Notation: δ = logp − anchor (the
anchor is `old_logp` or the rollout `rollout_logp`), ρ = exp(clip(δ, ±20)),
A the advantages, m the mask, w the IS weights, sg = stop_gradient.

=============  =====================================================  =======
name           ℓ                                                      anchor
=============  =====================================================  =======
cispo_rollout  −sg(clip(ρ_μ, 1−κ_l, 1+κ_h))·A·logp                   μ
dppo_mu_tv     −A·ρ_μ·valid_tv (ratio differentiated, no cap)         μ
dppo_mu_kl     −A·ρ_μ·valid_kl                                        μ
m2po           max(−Aρ, −A·clip(ρ, e^−τ, e^τ))·w, τ batch-global      π_old
topr           −A·logp·sg(t_i)·w, t_i = 1 if Ā_i ≥ 0 else clip(ρ̄_i)   π_old
=============  =====================================================  =======

References (goldens in `tests/golden/frontier/`, divergences in
docs/correction.md §4): SkyRL #1859 (`cispo_anchor='rollout'`), SkyRL's
`dppo_policy_loss` (e713bdeb2), verl PR #4131 (M2PO, second-moment trust
region) and verl PR #6986 (TOPR, tapered off-policy REINFORCE).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcorr.losses import masked
from jaxcorr.losses.policy_base import LossInputs, Metrics, PolicyKnobs

sg = jax.lax.stop_gradient

M2PO_UNCONSTRAINED = (0.0, 100000.0)
"""The ratio bounds M2PO uses when the harmful tokens are within budget."""
HARMFUL_ADV_EPS = 1e-12
TOPR_LOG_RATIO_CAP = 10.0


def _prepare(
  logp: jax.Array,
  anchor: jax.Array,
  advantages: jax.Array,
  mask: jax.Array,
  is_weights: jax.Array | None,
  anchor_name: str,
):
  """Trace-time checks and the input-side `where` (padding zeroed)."""
  masked.check_mask(mask)
  masked.require(anchor, anchor_name, 'by this policy loss')
  masked.check_shapes(
    {
      'logp': logp,
      anchor_name: anchor,
      'advantages': advantages,
      'mask': mask,
      'is_weights': is_weights,
    }
  )
  dtype = masked.float_dtype(logp, anchor, advantages, is_weights)

  def const(v):
    if v is None:
      return None
    return masked.sanitize(sg(v), mask, dtype)

  return (
    masked.sanitize(logp, mask, dtype),
    const(anchor),
    const(advantages),
    const(is_weights),
  )


def _mmean(v: jax.Array, mask: jax.Array, dtype) -> jax.Array:
  return masked.masked_mean(v.astype(dtype), mask)


# ----------------------------------------------------------- μ-anchored


def cispo_rollout(
  logp: jax.Array,
  rollout_logp: jax.Array,
  advantages: jax.Array,
  mask: jax.Array,
  *,
  clip_low: float = 1.0,
  clip_high: float = 4.0,
) -> tuple[jax.Array, Metrics]:
  """CISPO with its ratio taken against the rollout policy μ (SkyRL #1859).

  `ρ_μ = exp(clip(logp − rollout_logp, ±20))`,
  `ℓ = −sg(clip(ρ_μ, 1 − clip_low, 1 + clip_high))·A·logp`. The ratio
  already divides by μ, so no IS weights are taken (SkyRL refuses TIS too).

  Args:
    logp: `[B, T]` log π_θ (differentiated).
    rollout_logp: `[B, T]` log μ from the rollout engine.
    advantages: `[B, T]` A.
    mask: bool `[B, T]`.
    clip_low, clip_high: κ_l, κ_h (SkyRL defaults 1.0 and 4.0: ρ in [0, 5]).

  Returns:
    `(ℓ [B, T], metrics)`: `actor/pg_clipfrac` (ρ ≠ its clip), and
    `actor/cispo_ratio_{mean,clamped_mean,max,min}` over valid tokens (max
    and min 0 for an empty mask).
  """
  logp, mu, adv, _ = _prepare(
    logp, rollout_logp, advantages, mask, None, 'rollout_logp'
  )
  dtype = logp.dtype
  rho = masked.exp_clamped(sg(logp) - mu)
  clamped = jnp.clip(rho, 1 - clip_low, 1 + clip_high)
  loss = -sg(clamped) * adv * logp
  metrics = {
    'actor/pg_clipfrac': _mmean(rho != clamped, mask, dtype),
    'actor/cispo_ratio_mean': _mmean(rho, mask, dtype),
    'actor/cispo_ratio_clamped_mean': _mmean(clamped, mask, dtype),
    'actor/cispo_ratio_max': masked.masked_max(rho, mask),
    'actor/cispo_ratio_min': masked.masked_min(rho, mask),
  }
  return loss, metrics


def dppo_mu(
  logp: jax.Array,
  rollout_logp: jax.Array,
  advantages: jax.Array,
  mask: jax.Array,
  *,
  kind: str = 'tv',
  delta_low: float = 0.2,
  delta_high: float = 0.2,
) -> tuple[jax.Array, Metrics]:
  """SkyRL's DPPO: a μ-anchored ratio, differentiated, under a binary mask.

  p = exp(logp), μp = exp(rollout_logp), `ρ_μ = exp(clip(logp − log μ, ±20))`.
  tv: `masked = A > 0 ∧ p − μp > δ_h  ∨  A < 0 ∧ μp − p > δ_l`;
  kl: with `kl = KL(Bern(μp) ‖ Bern(p))`,
  `masked = A > 0 ∧ p > μp ∧ kl > δ_h  ∨  A < 0 ∧ p < μp ∧ kl > δ_l`;
  `ℓ = −A·ρ_μ·(1 − masked)` (gradient `−A·ρ_μ` per kept token). verl's DPPO
  instead anchors at π_old and uses `−A·sg(min(ρ, c))·logp` (`dppo_tv`,
  `dppo_kl`; same gradient at ρ ≤ c, D20 in docs/correction.md).

  Args:
    logp, rollout_logp, advantages: `[B, T]`; mask: bool `[B, T]`.
    kind: 'tv' or 'kl' (static).
    delta_low, delta_high: δ_l, δ_h (> 0).

  Returns:
    `(ℓ, {'actor/pg_clipfrac': mmean(masked)})`.
  """
  if kind not in ('tv', 'kl'):
    raise ValueError(f"dppo_mu kind={kind!r} is invalid; allowed: 'tv', 'kl'")
  logp, mu, adv, _ = _prepare(
    logp, rollout_logp, advantages, mask, None, 'rollout_logp'
  )
  lp = sg(logp)
  p, pmu = jnp.exp(lp), jnp.exp(mu)
  pos, neg = adv > 0, adv < 0
  if kind == 'tv':
    hit = (pos & (p - pmu > delta_high)) | (neg & (pmu - p > delta_low))
  else:
    kl = pmu * (mu - lp) + (1 - pmu) * jnp.log(
      (1 - pmu + 1e-8) / (1 - p + 1e-8)
    )
    hit = (pos & (p > pmu) & (kl > delta_high)) | (
      neg & (p < pmu) & (kl > delta_low)
    )
  rho = masked.exp_clamped(logp - mu)
  loss = jnp.where(hit, 0, -adv * rho)
  return loss, {'actor/pg_clipfrac': _mmean(hit, mask, logp.dtype)}


# ----------------------------------------------------------------- M2PO


def water_fill_tau(
  sorted_d2: jax.Array, n: jax.Array, target: jax.Array
) -> jax.Array:
  """τ with `Σ_i min(d2_i, τ²) = target` over the first n sorted entries.

  Water-filling: with `P_k = Σ_{i<k} d2_i`, the level `t_k = (target − P_k)
  / (n − k)` is the answer at the first k with `d2_{k−1} ≤ t_k ≤ d2_k`
  (`d2_{−1} = 0`). Entries at or past n are ignored. Requires
  `0 ≤ target < Σ d2` (the caller handles the unconstrained case); returns
  `sqrt(t)` (0 for target 0).

  Args:
    sorted_d2: `[N]` ascending; entries ≥ n may hold anything (e.g. inf).
    n: scalar count of entries that take part.
    target: scalar `budget·n`.
  """
  size = sorted_d2.shape[0]
  k = jnp.arange(size)
  live = k < n
  d2 = jnp.where(live, sorted_d2, 0)
  prefix = jnp.cumsum(d2) - d2
  level = (target - prefix) / jnp.maximum(n - k, 1).astype(d2.dtype)
  prev = jnp.concatenate([jnp.zeros((1,), d2.dtype), d2[:-1]])
  ok = live & (level >= prev) & (level <= d2)
  first = jnp.argmax(ok)
  t = jnp.where(jnp.any(ok), level[first], 0)
  return jnp.sqrt(jnp.maximum(t, 0))


def m2po_bounds(
  delta: jax.Array,
  harmful: jax.Array,
  m2_budget: float,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """M2PO's batch-global ratio bounds `(lo, hi, m2, m2_after)`.

  `M2 = mean δ²` over the harmful tokens of the whole call. When there is
  none or `M2 ≤ budget`: `(0, 1e5)` and `m2_after = M2`. Otherwise
  `τ = water_fill_tau(sort(δ²), n, budget·n)` (τ = 0 for a budget ≤ 1e-12)
  and the bounds are `(e^−τ, e^τ)`, `m2_after = mean min(δ², τ²)`.
  Everything is stop-gradient.

  Args:
    delta: `[B, T]` log-ratio δ (only its square is used).
    harmful: bool `[B, T]` harmful tokens.
    m2_budget: the second-moment budget (≥ 0).
  """
  d2 = sg(jnp.square(delta))
  dtype = d2.dtype
  n = masked.count(harmful, dtype)
  m2 = masked.masked_mean(d2, harmful)
  flat = jnp.where(harmful, d2, jnp.inf).reshape(-1)
  sharding = jax.typeof(flat).sharding
  if any(axis is not None for axis in sharding.spec):
    # Explicitly sharded rows: the sort needs the whole batch on every
    # device (the selection is batch-global by definition).
    flat = jax.sharding.reshard(flat, NamedSharding(sharding.mesh, P()))
  flat = jnp.sort(flat)
  target = jnp.asarray(m2_budget, dtype) * n
  if m2_budget <= 1e-12:
    tau = jnp.zeros((), dtype)
  else:
    tau = water_fill_tau(flat, n, target)
  clip = (n > 0) & (m2 > m2_budget)
  lo = jnp.where(clip, jnp.exp(-tau), M2PO_UNCONSTRAINED[0])
  hi = jnp.where(clip, jnp.exp(tau), M2PO_UNCONSTRAINED[1])
  after = masked.masked_mean(jnp.minimum(d2, jnp.square(tau)), harmful)
  return lo, hi, m2, jnp.where(clip, after, m2)


def m2po(
  logp: jax.Array,
  old_logp: jax.Array,
  advantages: jax.Array,
  mask: jax.Array,
  *,
  is_weights: jax.Array | None = None,
  m2_budget: float = 0.04,
  miniclip_low: float | None = None,
  miniclip_high: float | None = None,
) -> tuple[jax.Array, Metrics]:
  """M2PO: PPO clip whose bounds cap the second moment of stale log-ratios.

  δ = old_logp − logp, ρ = exp(clip(−δ, ±20)); harmful tokens are valid with
  `A > 1e-12 ∧ ρ > 1` or `A < −1e-12 ∧ ρ < 1`. `(lo, hi) = m2po_bounds(δ,
  harmful, m2_budget)` over the whole batch (one τ per call: the selection
  is batch-global, so micro-batching changes it). `miniclip_low/high` widen
  the bounds to at least `[1 − low, 1 + high]`.
  `ℓ = max(−Aρ, −A·clip(ρ, lo, hi))·w`.

  Args:
    logp, old_logp, advantages: `[B, T]`; mask: bool `[B, T]`.
    is_weights: optional `[B, T]` IS weights w.
    m2_budget: the budget on mean δ² (≥ 0; verl PR #4131 default 0.04).
    miniclip_low, miniclip_high: optional minimum clip widths.

  Returns:
    `(ℓ, metrics)`: `actor/pg_clipfrac`, `actor/pg_clipfrac_lower` (0),
    `actor/ppo_kl`, `m2po/clip_low` = 1 − lo, `m2po/clip_high` = hi − 1,
    `m2po/m2`, `m2po/m2_after`, `m2po/m2_budget`.
  """
  logp, old, adv, w = _prepare(
    logp, old_logp, advantages, mask, is_weights, 'old_logp'
  )
  dtype = logp.dtype
  d = logp - old
  rho = masked.exp_clamped(d)
  rho_sg = sg(rho)
  harmful = mask & (
    ((adv > HARMFUL_ADV_EPS) & (rho_sg > 1))
    | ((adv < -HARMFUL_ADV_EPS) & (rho_sg < 1))
  )
  lo, hi, m2, after = m2po_bounds(-d, harmful, m2_budget)
  if miniclip_low is not None:
    lo = jnp.minimum(lo, 1 - miniclip_low)
  if miniclip_high is not None:
    hi = jnp.maximum(hi, 1 + miniclip_high)
  l1 = -adv * rho
  l2 = -adv * jnp.clip(rho, lo, hi)
  loss = jnp.maximum(l1, l2)
  if w is not None:
    loss = loss * w
  metrics = {
    'actor/pg_clipfrac': _mmean(l2 > l1, mask, dtype),
    'actor/pg_clipfrac_lower': jnp.zeros((), dtype),
    'actor/ppo_kl': _mmean(-jnp.clip(sg(d), -20, 20), mask, dtype),
    'm2po/clip_low': 1 - lo,
    'm2po/clip_high': hi - 1,
    'm2po/m2': m2,
    'm2po/m2_after': after,
    'm2po/m2_budget': jnp.asarray(m2_budget, dtype),
  }
  return loss, metrics


# ----------------------------------------------------------------- TOPR


def topr(
  logp: jax.Array,
  old_logp: jax.Array,
  advantages: jax.Array,
  mask: jax.Array,
  *,
  is_weights: jax.Array | None = None,
  negative_ratio_lower: float = 0.0,
  negative_ratio_upper: float = 1.0,
) -> tuple[jax.Array, Metrics]:
  """TOPR, tapered off-policy REINFORCE (verl PR #6986).

  Per row, `n_i = max(Σ_t m, 1)`, `s_i = Σ_t δ·m / n_i` (δ = logp −
  old_logp), `ρ̄_i = exp(min(s_i, 10))`, `Ā_i = Σ_t A·m / n_i`;
  `t_i = 1` if `Ā_i ≥ 0` else `clip(ρ̄_i, lower, upper)`;
  `ℓ = −A·logp·sg(t_i)·w`. Natural aggregation `seq_mean_token_mean`; unlike
  verl, an explicit `agg` is honoured (D22 in docs/correction.md).

  Args:
    logp, old_logp, advantages: `[B, T]`; mask: bool `[B, T]`.
    is_weights: optional `[B, T]` IS weights w.
    negative_ratio_lower, negative_ratio_upper: the taper's clip range.

  Returns:
    `(ℓ, metrics)`: `actor/ppo_kl`, `actor/topr_negative_seq_frac` and
    `actor/topr_taper_weight_mean`, both over the non-empty rows (D4; verl
    counts empty rows, with Ā = 0 and weight 1).
  """
  logp, old, adv, w = _prepare(
    logp, old_logp, advantages, mask, is_weights, 'old_logp'
  )
  dtype = logp.dtype
  d = sg(logp) - old
  n = jnp.maximum(masked.row_count(mask, dtype), 1)
  s = jnp.sum(d, axis=-1) / n
  rho = jnp.exp(jnp.minimum(s, TOPR_LOG_RATIO_CAP))
  a_bar = jnp.sum(adv, axis=-1) / n
  negative = a_bar < 0
  taper = jnp.where(
    negative, jnp.clip(rho, negative_ratio_lower, negative_ratio_upper), 1
  )
  loss = -adv * logp * sg(taper)[:, None]
  if w is not None:
    loss = loss * w
  valid = masked.row_count(mask, dtype) > 0
  metrics = {
    'actor/ppo_kl': _mmean(-jnp.clip(d, -20, 20), mask, dtype),
    'actor/topr_negative_seq_frac': masked.rows_mean(
      negative.astype(dtype), valid
    ),
    'actor/topr_taper_weight_mean': masked.rows_mean(taper, valid),
  }
  return loss, metrics


# --------------------------------------------- registry adapters (policy.py)


def entry_cispo_rollout(x: LossInputs, k: PolicyKnobs):
  """Registry adapter: κ = `cispo_clip_low/high`, else ε_l/ε_h."""
  clip_low, clip_high = k.cispo_bounds
  return cispo_rollout(
    x.logp,
    x.rollout_logp,
    x.adv,
    x.mask,
    clip_low=clip_low,
    clip_high=clip_high,
  )


def _entry_dppo_mu(kind):
  def entry(x: LossInputs, k: PolicyKnobs):
    delta_low, delta_high, _ = k.dppo_bounds  # no ratio cap (D20)
    return dppo_mu(
      x.logp,
      x.rollout_logp,
      x.adv,
      x.mask,
      kind=kind,
      delta_low=delta_low,
      delta_high=delta_high,
    )

  entry.__doc__ = f'Registry adapter of `dppo_mu(kind={kind!r})`.'
  return entry


entry_dppo_mu_tv = _entry_dppo_mu('tv')
entry_dppo_mu_kl = _entry_dppo_mu('kl')


def entry_m2po(x: LossInputs, k: PolicyKnobs):
  """Registry adapter: knobs `m2_budget`, `m2po_miniclip_low/high`."""
  return m2po(
    x.logp,
    x.old_logp,
    x.adv,
    x.mask,
    is_weights=x.w,
    m2_budget=k.m2_budget,
    miniclip_low=k.m2po_miniclip_low,
    miniclip_high=k.m2po_miniclip_high,
  )


def entry_topr(x: LossInputs, k: PolicyKnobs):
  """Registry adapter: knobs `topr_negative_ratio_lower/upper`."""
  return topr(
    x.logp,
    x.old_logp,
    x.adv,
    x.mask,
    is_weights=x.w,
    negative_ratio_lower=k.topr_negative_ratio_lower,
    negative_ratio_upper=k.topr_negative_ratio_upper,
  )
