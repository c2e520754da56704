"""What every policy loss receives, and the accessors the losses share
(docs/math/losses.md §4.1, §4.4).

Every policy loss of the registry (`jaxcorr.losses.policy.registry.LOSSES`)
has the one signature

    fn(x: LossInputs, k: PolicyKnobs) -> (per_token, metrics)

`x` carries the arrays of one `policy_loss` call after the dispatcher has
checked, promoted and sanitised them: every float array is
`where(mask, x, 0)` in the computation dtype, and everything except `logp`
is wrapped in `stop_gradient`, so a loss never sees padding content. `k`
holds every knob of docs/math/losses.md §4.4 (typed, validated once when
built). `per_token` is the `[B, T]` loss ℓ *including* the IS weights, and
`metrics` a dict of scalar arrays under `actor/`; the dispatcher aggregates
ℓ.

`PolicyKnobs` is the one declaration of every knob: name, type, default,
allowed values and doc. `ActorLossConfig` (and so `config.actor`) inherits
its fields, so a new knob is one `setting` here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcorr.config.fields import fail_assign, number, optional, setting
from jaxcorr.config.fields import validate as validate_fields
from jaxcorr.losses import masked

Metrics = dict[str, jax.Array]


class LossInputs(NamedTuple):
  """Sanitised inputs of one policy-loss call; all arrays are `[B, T]`.

  Attributes:
    logp: log π_θ, the only array that carries gradient.
    old_logp: log π_old (stop-gradient), None when the loss does not read it.
    rollout_logp: log μ (stop-gradient), None when not given.
    adv: advantages A (stop-gradient).
    w: IS weights (stop-gradient), None for "no weights" (w = 1).
    mask: bool mask m (the corrected mask).
    key: PRNG key (clip_cov only), or None.
    pick: injected clip_cov selection (bool), or None.
  """

  logp: jax.Array
  old_logp: jax.Array | None
  rollout_logp: jax.Array | None
  adv: jax.Array
  w: jax.Array | None
  mask: jax.Array
  key: jax.Array | None = None
  pick: jax.Array | None = None


_GE0 = number(0, finite=False, allowed='a number >= 0')
_GT0 = number(0, lo_open=True, finite=False, allowed='a number > 0')
_ANY = number(finite=False, allowed='a number (not NaN)')


@dataclasses.dataclass(frozen=True)
class PolicyKnobs:
  """The policy-loss knobs (docs/math/losses.md §4.4), with verl's defaults
  (prime-rl's for `prime_*`); a knob None "falls back" as its doc says. Frozen,
  hashable, validated when built; a loss reads the ones it uses
  (`k.clip_ratio_low`).
  """

  clip_ratio_low: float = setting(
    0.2,
    _GE0,
    'ε_l >= 0, lower PPO clip (vanilla, gspo, gspo_seq, clip_cov, geo_mean, '
    'rollout_is; fallback of cispo and dppo).',
  )
  clip_ratio_high: float = setting(
    0.2, _GE0, 'ε_h >= 0, upper PPO clip (same losses as clip_ratio_low).'
  )
  clip_ratio_c: float | None = setting(
    3.0,
    optional(number(1, lo_open=True, finite=False), 'no dual clip'),
    'Dual-clip constant c > 1 (vanilla; fallback of dppo_ratio_cap); None '
    '(CLI: inf) turns the dual clip off.',
  )
  tau_pos: float = setting(
    1.0, _GT0, 'SAPO temperature for positive advantages (> 0).'
  )
  tau_neg: float = setting(
    1.05, _GT0, 'SAPO temperature for negative advantages (> 0).'
  )
  clip_cov_ratio: float = setting(
    2e-4, _GT0, 'clip_cov: fraction of tokens exempted from the gradient.'
  )
  clip_cov_lb: float = setting(
    1.0,
    number(finite=False, allowed='a number < clip_cov_ub'),
    'clip_cov: lower end of the covariance band (< clip_cov_ub).',
  )
  clip_cov_ub: float = setting(
    5.0,
    number(finite=False, allowed='a number > clip_cov_lb'),
    'clip_cov: upper end of the covariance band (> clip_cov_lb).',
  )
  kl_cov_ratio: float = setting(
    2e-4,
    _GT0,
    'kl_cov: fraction of top-covariance tokens that get the |δ| penalty.',
  )
  ppo_kl_coef: float = setting(
    0.1, _GE0, 'kl_cov: coefficient of the |δ| penalty (>= 0).'
  )
  dro_beta: float | None = setting(
    None,
    optional(_GT0, 'required by dro'),
    'dro: β of the squared log-ratio penalty; required (> 0) by dro.',
  )
  dppo_delta_low: float | None = setting(
    None,
    optional(_GT0, 'clip_ratio_low'),
    'dppo_tv / dppo_kl: lower threshold δ_l > 0; None falls back to ε_l.',
  )
  dppo_delta_high: float | None = setting(
    None,
    optional(_GT0, 'clip_ratio_high'),
    'dppo_tv / dppo_kl: upper threshold δ_h > 0; None falls back to ε_h.',
  )
  dppo_ratio_cap: float | None = setting(
    None,
    optional(_GT0, 'clip_ratio_c'),
    'dppo_tv / dppo_kl: ratio cap c_d > 0; None falls back to clip_ratio_c.',
  )
  cispo_clip_low: float | None = setting(
    None,
    optional(_GE0, 'clip_ratio_low'),
    'cispo: lower ratio bound κ_l >= 0; None falls back to ε_l.',
  )
  cispo_clip_high: float | None = setting(
    None,
    optional(_GE0, 'clip_ratio_high'),
    'cispo: upper ratio bound κ_h >= 0; None falls back to ε_h.',
  )
  prime_mask_low: float = setting(
    0.2, _GT0, 'prime: mask a token when π_θ − μ < −prime_mask_low and A <= 0.'
  )
  prime_mask_high: float = setting(
    0.2, _GT0, 'prime: mask a token when π_θ − μ > prime_mask_high and A > 0.'
  )
  prime_adv_tau: float = setting(1.0, _ANY, 'prime: advantage scale τ_A.')
  prime_kl_tau: float = setting(
    1e-3, _GE0, 'prime: coefficient τ_KL >= 0 of (log π_θ − log μ)².'
  )
  m2_budget: float = setting(
    0.04,
    _GE0,
    'm2po: budget (>= 0) on the mean squared log-ratio of harmful tokens.',
  )
  m2po_miniclip_low: float | None = setting(
    None,
    optional(_GE0, 'no floor'),
    'm2po: the lower ratio bound is at most 1 − low (>= 0); None: no floor.',
  )
  m2po_miniclip_high: float | None = setting(
    None,
    optional(_GE0, 'no floor'),
    'm2po: the upper ratio bound is at least 1 + high (>= 0); None: no floor.',
  )
  topr_negative_ratio_lower: float = setting(
    0.0,
    _GE0,
    'topr: lower clip (>= 0) of the taper weight of negative-advantage rows.',
  )
  topr_negative_ratio_upper: float = setting(
    1.0,
    _GT0,
    'topr: upper clip (> 0) of the taper weight of negative-advantage rows.',
  )

  def __post_init__(self):
    validate_knobs(self)

  @property
  def cispo_bounds(self) -> tuple[float, float]:
    """(κ_l, κ_h): `cispo_clip_low/high`, else ε_l, ε_h."""
    lo, hi = self.cispo_clip_low, self.cispo_clip_high
    return (
      self.clip_ratio_low if lo is None else lo,
      self.clip_ratio_high if hi is None else hi,
    )

  @property
  def dppo_bounds(self) -> tuple[float, float, float | None]:
    """(δ_l, δ_h, c_d): `dppo_delta_low/high`, else ε_l, ε_h;
    `dppo_ratio_cap`, else `clip_ratio_c` (None: no cap)."""
    lo, hi, cap = self.dppo_delta_low, self.dppo_delta_high, self.dppo_ratio_cap
    return (
      self.clip_ratio_low if lo is None else lo,
      self.clip_ratio_high if hi is None else hi,
      self.clip_ratio_c if cap is None else cap,
    )


KNOB_FIELDS: tuple[str, ...] = tuple(
  f.name for f in dataclasses.fields(PolicyKnobs)
)
"""Every knob name (the fields of `PolicyKnobs`)."""


def validate_knobs(obj: PolicyKnobs) -> str:
  """Field rules of `PolicyKnobs` (also on an `ActorLossConfig`), then the
  band check; returns the config path."""
  path = validate_fields(obj, assign_form=True)
  lb, ub = obj.clip_cov_lb, obj.clip_cov_ub
  if not lb < ub:
    fail_assign(
      f'{path}.clip_cov_lb',
      lb,
      'clip_cov_lb < clip_cov_ub',
      f'clip_cov_ub={ub!r}',
    )
  return path


LossFn = Callable[[LossInputs, PolicyKnobs], tuple[jax.Array, Metrics]]


def mmean(v: jax.Array, x: LossInputs) -> jax.Array:
  """`mmean(v)`: masked mean over `x.mask` (0 when the mask is empty)."""
  return masked.masked_mean(v.astype(x.logp.dtype), x.mask)


def zero(x: LossInputs) -> jax.Array:
  """A scalar 0 in the computation dtype (for metrics that are always 0)."""
  return jnp.zeros((), x.logp.dtype)


def clamp(r: jax.Array) -> jax.Array:
  """`clip(r, -20, 20)`: the safety bound δ̂ (D11)."""
  return jnp.clip(r, -masked.SAFETY_BOUND, masked.SAFETY_BOUND)


def old_delta(x: LossInputs) -> jax.Array:
  """δ = logp − old_logp (unclamped)."""
  return x.logp - x.old_logp


def weighted(per_token: jax.Array, x: LossInputs) -> jax.Array:
  """`ℓ·w`: IS weights multiply the loss after all clipping (verl)."""
  return per_token if x.w is None else per_token * x.w


def clip_metrics(
  x: LossInputs, delta: jax.Array, clipfrac: jax.Array, lower: jax.Array
) -> Metrics:
  """The default metric triple; `ppo_kl = mmean(−δ̂)`."""
  return {
    'actor/pg_clipfrac': clipfrac,
    'actor/pg_clipfrac_lower': lower,
    'actor/ppo_kl': mmean(-clamp(delta), x),
  }


def rank(score: jax.Array) -> jax.Array:
  """Rank of each entry of `score` in ascending order over every axis.

  Ties keep the flat (row-major) order, so the lower flat index ranks
  first. Returns an int array of the same shape. Explicitly sharded inputs
  are gathered (replicated) before the sort.
  """
  flat = score.reshape(-1)
  sharding = jax.typeof(flat).sharding
  if any(axis is not None for axis in sharding.spec):
    # Explicitly sharded (e.g. rows over a data axis): a sort needs the whole
    # sorting dimension on every device, so gather it first.
    flat = jax.sharding.reshard(flat, NamedSharding(sharding.mesh, P()))
  order = jnp.argsort(flat, stable=True)
  ranks = (
    jnp.zeros(flat.shape, jnp.int32)
    .at[order]
    .set(jnp.arange(flat.size, dtype=jnp.int32))
  )
  return ranks.reshape(score.shape)
