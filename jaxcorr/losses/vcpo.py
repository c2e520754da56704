"""VCPO: variance-controlled off-policy updates (Huang et al., "Stable
Asynchrony: Variance-Controlled Off-Policy RL for LLMs", arXiv 2602.17616;
the authors' code mit-han-lab/vcpo at c7f030f0, a verl fork:
recipe/fully_async_policy/staleness_utils.py and
verl/workers/actor/megatron_actor.py). docs/algorithms.md "VCPO".

Both parts read the sequence importance weight of each row,

    w_i = π_old(τ_i) / μ(τ_i) = exp Σ_t m_it (log π_old − log μ)_it,

the product over its response tokens (the authors' `rollout_seq_is`).

* **ESS-scaled step** (the paper's ρ_ess and η_eff ∝ √ρ_ess):

      ρ_ess = ESS / N = (Σ_i w_i)² / (N Σ_i w_i²)         (ρ ∈ (0, 1])
      s = min(1, ρ_ess / ρ_base)^{1/2}   ('sqrt', AdamW)  or  ^1 ('linear')

  The optimizer's update of the mini-batch is multiplied by s, which for
  optax's Adam/AdamW chains is the authors' learning rate × s (the update
  is linear in the learning rate, weight decay included). ρ is computed in
  log space, `exp(2·LSE(l) − LSE(2l) − log N)` with `l_i = log w_i`: the
  same number, finite where `exp Σ_t` would overflow float32.

* **Off-policy optimal baseline (OPOB)**, the closed-form minimum-variance
  baseline of the IS-weighted score-function estimator, per group g:

      b_g = Σ_{i∈g} w_i² ‖∇_θ log π_θ(τ_i)‖² R_i / Σ_{i∈g} w_i² ‖∇_θ log π_θ(τ_i)‖²
      A_i = R_i − b_g      (or (R_i − b_g)/(σ_g + ε) with norm_by_std)

  With every w_i = 1 and equal gradient norms b_g is the group mean and A_i
  is GRPO's advantage (Dr.GRPO's without the std).

Where this departs from the paper and the authors' code is listed in
docs/algorithms.md ("VCPO: departures"): no `+1e-8` in the ESS and
baseline denominators (an empty or all-zero set gives 0 instead), the
group std is jaxcorr's GRPO one (unbiased, + `algorithm.eps`), only the
`group` scope and the weighted `mean` aggregation, unclipped weights only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxcorr.config.fields import boolean, number, one_of, setting
from jaxcorr.losses import advantages as adv_lib
from jaxcorr.losses import masked
from jaxcorr.losses import rewards as rewards_lib

SCALING_RULES = ('sqrt', 'linear')
SCORE_NORMS = ('exact', 'uniform')


@dataclasses.dataclass(frozen=True)
class VCPOKnobs:
  """VCPO's fields; `ActorLossConfig` inherits them (`config.actor.<f>`).
  The reference names are the authors' verl fork's `actor.ess_scaling.*`
  and `actor.grad_baselining.*`."""

  ess_scaling: bool = setting(
    False,
    boolean,
    "VCPO's ESS-scaled step (authors: actor.ess_scaling.enable); needs "
    "correction.mode='decoupled' with an is_level (IS weights).",
  )
  ess_scaling_rule: str = setting(
    'sqrt',
    one_of(*SCALING_RULES),
    "Step multiplier min(1, ρ/ess_base_ratio)^p: 'sqrt' p=1/2 (Adam), "
    "'linear' p=1 (actor.ess_scaling.scaling_rule).",
  )
  ess_base_ratio: float = setting(
    1.0,
    number(0, 1, lo_open=True),
    'ρ at and above which the step is not scaled, in (0, 1] '
    '(actor.ess_scaling.base_ess_ratio).',
  )
  grad_baselining: bool = setting(
    False,
    boolean,
    "VCPO's off-policy optimal baseline replaces the advantages "
    '(actor.grad_baselining.enable); same needs as ess_scaling.',
  )
  baseline_use_is_weights: bool = setting(
    True,
    boolean,
    'Weigh the baseline by w_i² (grad_baselining.use_is_weights); False: '
    'by the gradient norms only.',
  )
  baseline_normalize_by_length: bool = setting(
    False,
    boolean,
    'Divide each baseline weight by L_i² (grad_baselining.'
    'normalize_by_length).',
  )
  baseline_norm_by_std: bool = setting(
    False,
    boolean,
    'Divide R_i − b_g by the group std + algorithm.eps (grad_baselining.'
    'norm_by_std).',
  )
  baseline_score_norm: str = setting(
    'exact',
    one_of(*SCORE_NORMS),
    "‖∇θ log π(τ_i)‖²: 'exact' (one backward pass per row at π_old, as the "
    "authors' micro-batch-1 pass) or 'uniform' (all 1: b_g is the w²-"
    'weighted mean; no extra passes).',
  )

  @property
  def vcpo_enabled(self) -> bool:
    return self.ess_scaling or self.grad_baselining


def check_vcpo(knobs: VCPOKnobs, corr_cfg) -> None:
  """Start-up rule: VCPO reads IS weights π_old/μ, so it needs the decoupled
  correction (π_old from the trainer) with an `is_level`."""
  if not knobs.vcpo_enabled:
    return
  on = 'ess_scaling' if knobs.ess_scaling else 'grad_baselining'
  ok = (
    corr_cfg is not None
    and corr_cfg.mode == 'decoupled'
    and corr_cfg.is_level is not None
  )
  if not ok:
    mode = None if corr_cfg is None else corr_cfg.mode
    level = None if corr_cfg is None else corr_cfg.is_level
    raise ValueError(
      f'actor.{on}=True needs IS weights, but correction.mode={mode!r}, '
      f"is_level={level!r}; allowed: correction.mode='decoupled' with "
      "is_level 'token' or 'sequence' (or actor.ess_scaling=False and "
      'actor.grad_baselining=False)'
    )


def check_estimator(knobs: VCPOKnobs, estimator: str, kl_in_reward) -> None:
  """Start-up rule: the baseline replaces GRPO's group baseline of the
  sequence rewards, so it takes `algorithm.estimator='grpo'` and no KL in
  reward (whose token rewards it would drop)."""
  if knobs.grad_baselining and (estimator != 'grpo' or kl_in_reward):
    raise ValueError(
      'actor.grad_baselining=True replaces the group baseline of the '
      f'sequence rewards, but algorithm.estimator={estimator!r}'
      f'{" with kl_in_reward" if kl_in_reward else ""}; allowed: '
      "estimator='grpo' without algorithm.kl_in_reward"
    )


def seq_log_weights(
  old_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array
) -> jax.Array:
  """`log w_i = Σ_t m_it (log π_old − log μ)_it`, float `[B]` (0 for an
  empty row); inputs `[B, T]`, no gradient."""
  masked.check_mask(mask)
  sg = jax.lax.stop_gradient
  delta = sg(masked.sanitize(old_logp, mask)) - sg(
    masked.sanitize(rollout_logp, mask)
  )
  return masked.row_sum(delta, mask)


@jax.jit
def ess_ratio(log_w: jax.Array, valid: jax.Array) -> jax.Array:
  """ρ_ess = (Σ w)² / (N Σ w²) over the valid rows (module docstring), a
  float scalar in [0, 1]; 0 with no valid row or every w_i = 0.

  Args:
    log_w: float `[B]` log-weights (−inf for a weight of 0).
    valid: bool `[B]` rows in the batch (N = Σ valid).
  """
  log_w = jnp.where(valid, masked.as_float(log_w), -jnp.inf)
  n = jnp.sum(valid, dtype=log_w.dtype)
  lse1 = jax.nn.logsumexp(log_w)
  lse2 = jax.nn.logsumexp(2.0 * log_w)
  rho = jnp.exp(2.0 * lse1 - lse2 - jnp.log(jnp.maximum(n, 1.0)))
  ok = (n > 0) & jnp.isfinite(lse2)
  return jnp.where(ok, jnp.minimum(rho, 1.0), jnp.zeros((), rho.dtype))


@functools.partial(jax.jit, static_argnames=('rule', 'base'))
def ess_step_scale(rho: jax.Array, *, rule: str, base: float) -> jax.Array:
  """The step multiplier `min(1, ρ/base)^{1/2}` ('sqrt') or `^1`
  ('linear'), the authors' `lr_scale`."""
  if rule not in SCALING_RULES:
    raise ValueError(f'rule={rule!r} is invalid; allowed: sqrt, linear')
  s = jnp.minimum(1.0, rho / base)
  return jnp.sqrt(s) if rule == 'sqrt' else s


@functools.partial(
  jax.jit, static_argnames=('use_is_weights', 'normalize_by_length')
)
def opob_baseline(
  rewards: jax.Array,
  log_w: jax.Array,
  score_sq_norms: jax.Array,
  lengths: jax.Array,
  group_ids: jax.Array,
  valid: jax.Array,
  *,
  use_is_weights: bool = True,
  normalize_by_length: bool = False,
) -> jax.Array:
  """The off-policy optimal baseline b_g of each row's group, float `[B]`:

      W_i = ‖g_i‖² · w_i² (use_is_weights) · L_i⁻² (normalize_by_length)
      b_g = Σ_{i∈g, valid} W_i R_i / Σ_{i∈g, valid} W_i  (0 if Σ W_i = 0)

  Args:
    rewards: float `[B]` sequence rewards R_i.
    log_w: float `[B]` `seq_log_weights`.
    score_sq_norms: float `[B]` ‖∇_θ log π_θ(τ_i)‖².
    lengths: float `[B]` response tokens L_i (only with normalize_by_length).
    group_ids: int `[B]` in [0, B).
    valid: bool `[B]` rows that are group members.
  """
  dtype = masked.float_dtype(rewards, score_sq_norms)
  zero = jnp.zeros((), dtype)
  weight = masked.sanitize(score_sq_norms, valid, dtype)
  if use_is_weights:
    # w² in log space, scaled by the largest w² of the batch: b_g is a ratio
    # and unchanged, and exp never overflows.
    lw2 = jnp.where(valid, 2.0 * masked.as_float(log_w, dtype), -jnp.inf)
    top = jnp.max(jnp.where(jnp.isfinite(lw2), lw2, -1e30))
    weight = weight * jnp.where(valid, jnp.exp(lw2 - top), zero)
  if normalize_by_length:
    length = masked.sanitize(lengths, valid, dtype)
    weight = masked.safe_div(weight, jnp.square(length))
  r = masked.sanitize(rewards, valid, dtype)
  num = adv_lib.group_sum(weight * r, group_ids)
  den = adv_lib.group_sum(weight, group_ids)
  return jnp.where(valid, masked.safe_div(num, den), zero)


@functools.partial(jax.jit, static_argnames=('norm_by_std',))
def opob_advantages(
  rewards: jax.Array,
  baseline: jax.Array,
  mask: jax.Array,
  group_ids: jax.Array,
  *,
  norm_by_std: bool = False,
  eps: float = 1e-6,
) -> jax.Array:
  """`A_i = R_i − b_g` (or `/(σ_g + eps)`, σ_g the group's unbiased std as
  in GRPO, 1 for a singleton) broadcast on row i's `mask`, float `[B, T]`,
  no gradient."""
  masked.check_mask(mask)
  valid = jnp.any(mask, axis=-1)
  dtype = masked.float_dtype(rewards, baseline)
  r = masked.sanitize(rewards, valid, dtype)
  adv = r - masked.sanitize(baseline, valid, dtype)
  if norm_by_std:
    scores = rewards_lib.place_at_last_token(r, mask)
    stats = adv_lib.group_stats(scores, mask, group_ids)
    adv = masked.safe_div(adv, stats.std + eps)
  adv = jax.lax.stop_gradient(adv)
  return jnp.where(mask, adv[:, None], jnp.zeros((), dtype))
