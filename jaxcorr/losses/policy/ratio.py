"""The ratio family: PPO-style surrogates of ρ = π_θ/π_anchor with a trust
region (docs/math/losses.md §4.2–§4.3).

The gradient reaches logp through the ratio (or, for DPPO's π_old form,
through `sg(ρ)·logp` under the same trust-region test); the losses differ in
how they keep the update near the anchor: PPO's clip and dual clip
(`vanilla`), its sequence forms (`gspo`, `gspo_seq`, `geo_mean`), a soft gate
(`sapo`), covariance exemptions (`clip_cov`, `kl_cov`), DPPO's binary
trust-region masks anchored at π_old (`dppo_tv`, `dppo_kl`) or at the
rollout policy μ (`dppo_mu_tv`, `dppo_mu_kl`), and M2PO's batch-global
second-moment bound on stale log-ratios (`m2po`).

Each function maps sanitised `LossInputs` and the typed `PolicyKnobs` to the
per-token loss ℓ `[B, T]` (IS weights included) and its metrics; see
`jaxcorr.losses.policy.inputs`.
Notation: δ = logp − old_logp, δ̂ = clip(δ, ±20), ρ = exp(δ̂), ε_l / ε_h =
`clip_ratio_low` / `clip_ratio_high`, ρ_μ = exp(clip(logp − rollout_logp,
±20)), w = IS weights, sg = stop_gradient, `mmean` the masked mean and
`rmean` the per-row masked mean.

References for the stale-data losses (goldens in `tests/golden/frontier/`,
divergences in docs/correction.md §4): SkyRL's `dppo_policy_loss`
(e713bdeb2) and verl PR #4131 (M2PO).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcorr.losses import masked
from jaxcorr.losses.policy.inputs import (
  LossInputs,
  Metrics,
  PolicyKnobs,
  clamp,
  clip_metrics,
  mmean,
  old_delta,
  rank,
  weighted,
  zero,
)

sg = jax.lax.stop_gradient

M2PO_UNCONSTRAINED = (0.0, 100000.0)
"""The ratio bounds M2PO uses when the harmful tokens are within budget."""
HARMFUL_ADV_EPS = 1e-12


def _ppo_terms(x: LossInputs, k: PolicyKnobs, rho: jax.Array):
  """`L1 = −A·ρ` and `L2 = −A·clip(ρ, 1−ε_l, 1+ε_h)`."""
  lo, hi = 1 - k.clip_ratio_low, 1 + k.clip_ratio_high
  return -x.adv * rho, -x.adv * jnp.clip(rho, lo, hi)


def vanilla(x: LossInputs, k: PolicyKnobs) -> tuple[jax.Array, Metrics]:
  """PPO clip with dual clip (verl; SkyRL regular/dual_clip; slime ppo).

  `L1 = −Aρ`, `L2 = −A·clip(ρ, 1−ε_l, 1+ε_h)`, `Lc = max(L1, L2)`,
  `L3 = −A·c` (c = `clip_ratio_c`); `ℓ = (A < 0 ? min(L3, Lc) : Lc)·w`.
  `clip_ratio_c=None` disables the dual clip (`ℓ = Lc·w`).
  Metrics: `pg_clipfrac = mmean(L2 > L1)`,
  `pg_clipfrac_lower = mmean(A < 0 ∧ Lc > L3)` (0 without dual clip),
  `ppo_kl = mmean(−δ̂)`.
  """
  d = old_delta(x)
  l1, l2 = _ppo_terms(x, k, masked.exp_clamped(d))
  lc = jnp.maximum(l1, l2)
  c = k.clip_ratio_c
  if c is None:
    loss, lower = lc, zero(x)
  else:
    l3 = -x.adv * c
    neg = x.adv < 0
    loss = jnp.where(neg, jnp.minimum(l3, lc), lc)
    lower = mmean(neg & (lc > l3), x)
  return weighted(loss, x), clip_metrics(x, d, mmean(l2 > l1, x), lower)


def gspo(x: LossInputs, k: PolicyKnobs) -> tuple[jax.Array, Metrics]:
  """GSPO-token with the stop-gradient trick (verl, SkyRL gspo).

  `s_i = rmean(δ)` (unclamped), `λ = min(logp − sg(logp) + sg(s_i), 10)`,
  `ρs = exp(λ)` (value `exp(min(s_i, 10))`, gradient of token t only through
  `logp_t`); `ℓ = max(−A·ρs, −A·clip(ρs, 1−ε_l, 1+ε_h))·w`.
  Metrics: `pg_clipfrac = mmean(L2 > L1)`, `pg_clipfrac_lower = 0`,
  `ppo_kl = mmean(−δ̂)`.
  """
  d = old_delta(x)
  s = masked.row_mean(d, x.mask)[:, None]
  lam = jnp.minimum(x.logp - sg(x.logp) + sg(s), 10.0)
  l1, l2 = _ppo_terms(x, k, masked.exp_clamped(lam))
  loss = jnp.maximum(l1, l2)
  return weighted(loss, x), clip_metrics(x, d, mmean(l2 > l1, x), zero(x))


def gspo_seq(x: LossInputs, k: PolicyKnobs) -> tuple[jax.Array, Metrics]:
  """GSPO-sequence (slime gspo): the ratio keeps its gradient through s_i.

  `s_i = rmean(δ)`, `ρ_i = exp(min(s_i, 10))` broadcast over the row;
  `ℓ = max(−A·ρ_i, −A·clip(ρ_i, 1−ε_l, 1+ε_h))·w`. Same value as `gspo`;
  token t receives `(Σ_s ∂ℓ_s/∂ρ_i)·ρ_i·m_t/n_i`. Metrics as `gspo`.
  """
  d = old_delta(x)
  s = masked.row_mean(d, x.mask)[:, None]
  rho = masked.exp_clamped(jnp.minimum(s, 10.0))
  l1, l2 = _ppo_terms(x, k, jnp.broadcast_to(rho, d.shape))
  loss = jnp.maximum(l1, l2)
  return weighted(loss, x), clip_metrics(x, d, mmean(l2 > l1, x), zero(x))


def sapo(x: LossInputs, k: PolicyKnobs) -> tuple[jax.Array, Metrics]:
  """SAPO soft gate (verl, SkyRL).

  `τ = tau_pos` where A > 0, else `tau_neg`;
  `ℓ = −(4/τ)·sigmoid(τ(ρ − 1))·A·w`. Both clip fractions are 0.
  """
  d = old_delta(x)
  rho = masked.exp_clamped(d)
  tau = jnp.where(x.adv > 0, k.tau_pos, k.tau_neg).astype(d.dtype)
  gate = jax.nn.sigmoid(tau * (rho - 1)) * (4 / tau)
  loss = -x.adv * gate
  return weighted(loss, x), clip_metrics(x, d, zero(x), zero(x))


def _cov(x: LossInputs) -> jax.Array:
  """`(A − mmean(A))·(sg logp − mmean(sg logp))`, per token."""
  lp = sg(x.logp)
  return (x.adv - mmean(x.adv, x)) * (lp - mmean(lp, x))


def clip_cov(x: LossInputs, k: PolicyKnobs) -> tuple[jax.Array, Metrics]:
  """Clip-Cov (verl, SkyRL): PPO clip with random high-covariance exemptions.

  L1, L2 as in `vanilla` (no dual clip); `cov = (A − mmean A)(logp −
  mmean sg logp)`; candidates `m ∧ ¬(L2 > L1) ∧ lb < cov < ub`;
  `n = max(⌊clip_cov_ratio·Σm⌋, 1)`; min(n, #candidates) candidates are
  drawn uniformly without replacement with `x.key` (uniform scores, the n
  lowest ranks win), or taken from the injected `x.pick` (D10).
  `corr = 0` on the picked tokens, else 1; `ℓ = max(L1, L2)·corr·w`.
  Metrics: `pg_clipfrac = mmean(corr == 0)`, `ppo_kl = mmean(−δ̂)`.
  """
  d = old_delta(x)
  l1, l2 = _ppo_terms(x, k, masked.exp_clamped(d))
  if x.pick is not None:
    pick = x.pick & x.mask
  else:
    cov = _cov(x)
    cand = x.mask & ~(l2 > l1)
    cand = cand & (cov > k.clip_cov_lb) & (cov < k.clip_cov_ub)
    total = masked.count(x.mask, d.dtype)
    n = jnp.maximum(jnp.floor(k.clip_cov_ratio * total), 1)
    score = jax.random.uniform(x.key, d.shape, d.dtype)
    score = jnp.where(cand, score, jnp.inf)
    pick = cand & (rank(score) < n)
  loss = jnp.where(pick, 0, jnp.maximum(l1, l2))
  metrics = {
    'actor/pg_clipfrac': mmean(pick, x),
    'actor/ppo_kl': mmean(-clamp(d), x),
  }
  return weighted(loss, x), metrics


def kl_cov(x: LossInputs, k: PolicyKnobs) -> tuple[jax.Array, Metrics]:
  """KL-Cov (verl, SkyRL): a |δ| penalty on the top-covariance tokens.

  Over the N valid tokens, `cov = (A − Ā)(sg logp − l̄)` (plain means over
  the valid tokens); the top `max(1, ⌊N·kl_cov_ratio⌋)` tokens by cov (ties:
  lower flat index; N = 0 selects nothing) get `−Aρ + ppo_kl_coef·|δ|`, the
  others `−Aρ`; everything times w. The gradient of `|δ|` is sign(δ), 0 at
  δ = 0 (torch). Only metric: `ppo_kl = mmean(|δ|)`.
  """
  d = old_delta(x)
  base = -x.adv * masked.exp_clamped(d)
  with_kl = base + k.ppo_kl_coef * masked.abs_sign(d)
  total = masked.count(x.mask, d.dtype)
  n = jnp.where(total > 0, jnp.maximum(jnp.floor(total * k.kl_cov_ratio), 1), 0)
  score = jnp.where(x.mask, -_cov(x), jnp.inf)
  top = x.mask & (rank(score) < n)
  loss = jnp.where(top, with_kl, base)
  return weighted(loss, x), {'actor/ppo_kl': mmean(jnp.abs(d), x)}


def geo_mean(x: LossInputs, k: PolicyKnobs) -> tuple[jax.Array, Metrics]:
  """GMPO, the geometric-mean sequence loss (verl geo_mean).

  `x_t = sgn(A)·min(sgn(A)·δ̂, sgn(A)·clip(δ̂, −ε_l, ε_h))`,
  `ρ_i = exp(rmean(x))`, `Â_i = rmean(A)`, `w_i = exp(rmean(log(w + 1e-10)))`
  (1 without weights); `ℓ_i = −Â_i·ρ_i·w_i`, broadcast over the row, so the
  natural `seq_mean_token_mean` averages over non-empty rows (D12).
  Metrics: `pg_clipfrac = mmean(δ̂ ≠ clip δ̂ ∧ A > 0)`,
  `pg_clipfrac_lower = mmean(δ̂ ≠ clip δ̂ ∧ A < 0)`, `ppo_kl = mmean(−δ̂)`.
  """
  d = old_delta(x)
  dh = clamp(d)
  dc = jnp.clip(dh, -k.clip_ratio_low, k.clip_ratio_high)
  sgn = jnp.sign(x.adv)
  xt = sgn * jnp.minimum(sgn * dh, sgn * dc)
  rho = masked.exp_clamped(masked.row_mean(xt, x.mask))
  row = -masked.row_mean(x.adv, x.mask) * rho
  if x.w is not None:
    log_w = jnp.log(x.w + 1e-10)
    row = row * jnp.exp(masked.row_mean(log_w, x.mask))
  loss = jnp.broadcast_to(row[:, None], d.shape)
  clipped = dh != dc
  return loss, clip_metrics(
    x, d, mmean(clipped & (x.adv > 0), x), mmean(clipped & (x.adv < 0), x)
  )


def _dppo(x: LossInputs, k: PolicyKnobs, kind: str):
  """Shared body of `dppo_tv` and `dppo_kl`."""
  lo, hi, cap = k.dppo_bounds
  cap = jnp.inf if cap is None else cap
  d = old_delta(x)
  rho = masked.exp_clamped(d)
  lp = sg(x.logp)
  p, p0 = jnp.exp(lp), jnp.exp(x.old_logp)
  pos = x.adv > 0
  if kind == 'tv':
    valid = jnp.where(pos, p - p0 <= hi, p - p0 >= -lo)
  else:
    bkl = p0 * (x.old_logp - lp) + (1 - p0) * jnp.log(
      (1 - p0 + 1e-8) / (1 - p + 1e-8)
    )
    valid = jnp.where(pos, (bkl <= hi) | (p <= p0), (bkl <= lo) | (p >= p0))
  valid = sg(valid)
  loss = -x.adv * sg(jnp.minimum(rho, cap)) * x.logp * valid
  return weighted(loss, x), clip_metrics(
    x, d, mmean(~valid, x), mmean((rho > cap) & valid, x)
  )


def dppo_tv(x: LossInputs, k: PolicyKnobs) -> tuple[jax.Array, Metrics]:
  """DPPO binary-TV (verl dppo_tv).

  p = exp(logp), p0 = exp(old_logp); c_d = `dppo_ratio_cap`, else
  `clip_ratio_c` (no cap when both are None); δ_l, δ_h =
  `dppo_delta_low/high`, else ε_l, ε_h.
  `valid = A > 0 ? p − p0 ≤ δ_h : p − p0 ≥ −δ_l` (stop-gradient);
  `ℓ = −A·sg(min(ρ, c_d))·logp·valid·w`.
  Metrics: `pg_clipfrac = mmean(¬valid)`,
  `pg_clipfrac_lower = mmean(ρ > c_d ∧ valid)`, `ppo_kl = mmean(−δ̂)`.
  """
  return _dppo(x, k, 'tv')


def dppo_kl(x: LossInputs, k: PolicyKnobs) -> tuple[jax.Array, Metrics]:
  """DPPO binary-KL (verl dppo_kl); as `dppo_tv` with the KL test.

  `bkl = p0·(old_logp − logp) + (1−p0)·log((1−p0+1e-8)/(1−p+1e-8))`,
  `valid = A > 0 ? (bkl ≤ δ_h ∨ p ≤ p0) : (bkl ≤ δ_l ∨ p ≥ p0)`;
  `ℓ = −A·sg(min(ρ, c_d))·logp·valid·w`. Metrics as `dppo_tv`.
  """
  return _dppo(x, k, 'kl')


def _dppo_mu(x: LossInputs, k: PolicyKnobs, kind: str):
  """Shared body of `dppo_mu_tv` and `dppo_mu_kl`."""
  lo, hi, _ = k.dppo_bounds  # no ratio cap (D20)
  lp, mu = sg(x.logp), x.rollout_logp
  p, pmu = jnp.exp(lp), jnp.exp(mu)
  pos, neg = x.adv > 0, x.adv < 0
  if kind == 'tv':
    hit = (pos & (p - pmu > hi)) | (neg & (pmu - p > lo))
  else:
    kl = pmu * (mu - lp) + (1 - pmu) * jnp.log(
      (1 - pmu + 1e-8) / (1 - p + 1e-8)
    )
    hit = (pos & (p > pmu) & (kl > hi)) | (neg & (p < pmu) & (kl > lo))
  rho = masked.exp_clamped(x.logp - mu)
  loss = jnp.where(hit, 0, -x.adv * rho)
  return loss, {'actor/pg_clipfrac': mmean(hit, x)}


def dppo_mu_tv(x: LossInputs, k: PolicyKnobs) -> tuple[jax.Array, Metrics]:
  """SkyRL's DPPO binary-TV: a μ-anchored ratio, differentiated, under a
  binary mask; takes no IS weights.

  p = exp(logp), μp = exp(rollout_logp); δ_l, δ_h = `dppo_delta_low/high`,
  else ε_l, ε_h (no ratio cap, D20 in docs/correction.md).
  `masked = A > 0 ∧ p − μp > δ_h  ∨  A < 0 ∧ μp − p > δ_l`;
  `ℓ = −A·ρ_μ·(1 − masked)` (gradient `−A·ρ_μ` per kept token). verl's DPPO
  instead anchors at π_old and uses `−A·sg(min(ρ, c))·logp` (`dppo_tv`,
  `dppo_kl`; same gradient at ρ ≤ c). Only metric:
  `pg_clipfrac = mmean(masked)`.
  """
  return _dppo_mu(x, k, 'tv')


def dppo_mu_kl(x: LossInputs, k: PolicyKnobs) -> tuple[jax.Array, Metrics]:
  """SkyRL's DPPO binary-KL; as `dppo_mu_tv` with the KL test.

  With `kl = KL(Bern(μp) ‖ Bern(p)) = μp·(log μp − logp) + (1 − μp)·log((1
  − μp + 1e-8)/(1 − p + 1e-8))`: `masked = A > 0 ∧ p > μp ∧ kl > δ_h  ∨
  A < 0 ∧ p < μp ∧ kl > δ_l`; `ℓ = −A·ρ_μ·(1 − masked)`. Metrics as
  `dppo_mu_tv`.
  """
  return _dppo_mu(x, k, 'kl')


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
  idx = jnp.arange(size)
  live = idx < n
  d2 = jnp.where(live, sorted_d2, 0)
  prefix = jnp.cumsum(d2) - d2
  level = (target - prefix) / jnp.maximum(n - idx, 1).astype(d2.dtype)
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


def m2po(x: LossInputs, k: PolicyKnobs) -> tuple[jax.Array, Metrics]:
  """M2PO: PPO clip whose bounds cap the second moment of stale log-ratios
  (verl PR #4131).

  Harmful tokens are valid with `A > 1e-12 ∧ ρ > 1` or `A < −1e-12 ∧
  ρ < 1`. `(lo, hi) = m2po_bounds(−δ, harmful, m2_budget)` over the whole
  batch (one τ per call: the selection is batch-global, so micro-batching
  changes it). `m2po_miniclip_low/high` widen the bounds to at least
  `[1 − low, 1 + high]`. `ℓ = max(−Aρ, −A·clip(ρ, lo, hi))·w`.
  Metrics: `pg_clipfrac = mmean(L2 > L1)`, `pg_clipfrac_lower = 0`,
  `ppo_kl = mmean(−δ̂)`, `m2po/clip_low` = 1 − lo, `m2po/clip_high` =
  hi − 1, `m2po/m2`, `m2po/m2_after`, `m2po/m2_budget`.
  """
  d = old_delta(x)
  rho = masked.exp_clamped(d)
  rho_sg = sg(rho)
  harmful = x.mask & (
    ((x.adv > HARMFUL_ADV_EPS) & (rho_sg > 1))
    | ((x.adv < -HARMFUL_ADV_EPS) & (rho_sg < 1))
  )
  lo, hi, m2, after = m2po_bounds(-d, harmful, k.m2_budget)
  if k.m2po_miniclip_low is not None:
    lo = jnp.minimum(lo, 1 - k.m2po_miniclip_low)
  if k.m2po_miniclip_high is not None:
    hi = jnp.maximum(hi, 1 + k.m2po_miniclip_high)
  l1 = -x.adv * rho
  l2 = -x.adv * jnp.clip(rho, lo, hi)
  loss = jnp.maximum(l1, l2)
  metrics = {
    **clip_metrics(x, sg(d), mmean(l2 > l1, x), zero(x)),
    'm2po/clip_low': 1 - lo,
    'm2po/clip_high': hi - 1,
    'm2po/m2': m2,
    'm2po/m2_after': after,
    'm2po/m2_budget': jnp.asarray(k.m2_budget, x.logp.dtype),
  }
  return weighted(loss, x), metrics
