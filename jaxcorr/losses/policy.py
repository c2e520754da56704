"""The policy-loss registry and its dispatcher (spec losses.md §4).

    loss, metrics = policy_loss('vanilla', logp, old_logp, advantages, mask)

Every loss defines a per-token ℓ `[B, T]` (IS weights already applied, after
all clipping); the dispatcher then returns `aggregate(ℓ, mask, agg or
NATURAL_AGG[name], ...)`. With δ = logp − old_logp and ρ = exp(clip(δ, ±20)):

==========  ==============================================  ===============
name        ℓ                                               natural agg
==========  ==============================================  ===============
vanilla     PPO clip + dual clip · w                        token_mean
gspo        GSPO-token (stop-gradient trick) · w            seq_mean_token_mean
gspo_seq    GSPO-sequence (gradient through the row mean)   seq_mean_token_mean
sapo        −(4/τ)·σ(τ(ρ−1))·A · w                          seq_mean_token_mean
gpg         −A·logp · w                                     token_mean
cispo       −sg(clip(ρ, 1−κ_l, 1+κ_h))·A·logp · w           token_mean
clip_cov    PPO clip, random high-cov tokens exempted · w   token_mean
kl_cov      −Aρ (+ ppo_kl_coef·|δ| on top-cov tokens) · w   token_mean
geo_mean    GMPO row loss broadcast over the row            seq_mean_token_mean
dro         −(logp·A − ½β·δ²) · w                           token_mean
dppo_tv     −A·sg(min(ρ, c_d))·logp·valid_tv · w            token_mean
dppo_kl     −A·sg(min(ρ, c_d))·logp·valid_kl · w            token_mean
reinforce   −A·logp · w                                     token_mean
rollout_is  −sg(c)·A·logp, c = ρ_μ inside an open band      token_mean
prime       −keep·τ_A·A·ρ_μ + τ_KL·(logp − rollout_logp)²   token_mean
==========  ==============================================  ===============

`cispo_rollout`, `dppo_mu_tv`, `dppo_mu_kl`, `m2po` and `topr` (stale and
μ-anchored data) are defined with their formulas in `policy_stale`.

The formulas live in `policy_ppo` (ratio/clip family) and `policy_pg`
(REINFORCE family); this module holds the tables, the knob checks and the
dispatcher that checks, promotes, sanitises and stop-gradients the inputs.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping

import jax

from jaxcorr.losses import masked, policy_pg, policy_ppo, policy_stale
from jaxcorr.losses.aggregate import aggregate, canonical_mode
from jaxcorr.losses.policy_base import LossFn, LossInputs, Metrics

LOSSES: dict[str, LossFn] = {
  'vanilla': policy_ppo.vanilla,
  'gspo': policy_ppo.gspo,
  'gspo_seq': policy_ppo.gspo_seq,
  'sapo': policy_ppo.sapo,
  'gpg': policy_pg.gpg,
  'cispo': policy_ppo.cispo,
  'clip_cov': policy_ppo.clip_cov,
  'kl_cov': policy_ppo.kl_cov,
  'geo_mean': policy_ppo.geo_mean,
  'dro': policy_pg.dro,
  'dppo_tv': policy_ppo.dppo_tv,
  'dppo_kl': policy_ppo.dppo_kl,
  'reinforce': policy_pg.reinforce,
  'rollout_is': policy_pg.rollout_is,
  'prime': policy_pg.prime,
  'cispo_rollout': policy_stale.entry_cispo_rollout,
  'dppo_mu_tv': policy_stale.entry_dppo_mu_tv,
  'dppo_mu_kl': policy_stale.entry_dppo_mu_kl,
  'm2po': policy_stale.entry_m2po,
  'topr': policy_stale.entry_topr,
}
"""name -> per-loss function `(LossInputs, knobs) -> (ℓ [B, T], metrics)`."""

_TM, _SM = 'token_mean', 'seq_mean_token_mean'
NATURAL_AGG: dict[str, str] = {
  'vanilla': _TM,
  'gspo': _SM,
  'gspo_seq': _SM,
  'sapo': _SM,
  'gpg': _TM,
  'cispo': _TM,
  'clip_cov': _TM,
  'kl_cov': _TM,
  'geo_mean': _SM,
  'dro': _TM,
  'dppo_tv': _TM,
  'dppo_kl': _TM,
  'reinforce': _TM,
  'rollout_is': _TM,
  'prime': _TM,
  'cispo_rollout': _TM,
  'dppo_mu_tv': _TM,
  'dppo_mu_kl': _TM,
  'm2po': _TM,
  'topr': _SM,
}
"""The aggregation used when `agg=None` (an explicit agg always wins, D9)."""

READS: dict[str, str | None] = {
  **{name: 'old' for name in LOSSES},
  'gpg': None,
  'rollout_is': 'rollout',
  'prime': 'rollout',
  'cispo_rollout': 'rollout',
  'dppo_mu_tv': 'rollout',
  'dppo_mu_kl': 'rollout',
}
"""The second log-prob a loss reads: 'old', 'rollout' or None (gpg).

A loss that reads 'old' requires `old_logp`, except `reinforce`, which only
logs `ppo_kl` from it when given. A loss that reads 'rollout' requires
`rollout_logp` and ignores `old_logp`.
"""

USES_IS_WEIGHTS: dict[str, bool] = {
  **{name: True for name in LOSSES},
  'rollout_is': False,
  'prime': False,
  'cispo_rollout': False,
  'dppo_mu_tv': False,
  'dppo_mu_kl': False,
}
"""False where the loss already divides by μ: passing weights is an error."""

KNOB_DEFAULTS: dict[str, object] = {
  'clip_ratio_low': 0.2,
  'clip_ratio_high': 0.2,
  'clip_ratio_c': 3.0,
  'tau_pos': 1.0,
  'tau_neg': 1.05,
  'clip_cov_ratio': 2e-4,
  'clip_cov_lb': 1.0,
  'clip_cov_ub': 5.0,
  'kl_cov_ratio': 2e-4,
  'ppo_kl_coef': 0.1,
  'dro_beta': None,
  'dppo_delta_low': None,
  'dppo_delta_high': None,
  'dppo_ratio_cap': None,
  'cispo_clip_low': None,
  'cispo_clip_high': None,
  'prime_mask_low': 0.2,
  'prime_mask_high': 0.2,
  'prime_adv_tau': 1.0,
  'prime_kl_tau': 1e-3,
  'm2_budget': 0.04,
  'm2po_miniclip_low': None,
  'm2po_miniclip_high': None,
  'topr_negative_ratio_lower': 0.0,
  'topr_negative_ratio_upper': 1.0,
}
"""Every knob of §4.4 with its default (verl's, prime-rl's for `prime_*`)."""

# knob -> (predicate on a number, None allowed, what is allowed)
_Rule = tuple[Callable[[float], bool], bool, str]
_GE0: _Rule = (lambda v: v >= 0, False, 'a number >= 0')
_GT0: _Rule = (lambda v: v > 0, False, 'a number > 0')
_ANY: _Rule = (lambda v: not math.isnan(v), False, 'a number (not NaN)')
_RULES: dict[str, _Rule] = {
  'clip_ratio_low': _GE0,
  'clip_ratio_high': _GE0,
  'clip_ratio_c': (
    lambda v: v > 1,
    True,
    'a number > 1, or None (no dual clip)',
  ),
  'tau_pos': _GT0,
  'tau_neg': _GT0,
  'clip_cov_ratio': _GT0,
  'clip_cov_lb': (_ANY[0], False, 'a number < clip_cov_ub'),
  'clip_cov_ub': (_ANY[0], False, 'a number > clip_cov_lb'),
  'kl_cov_ratio': _GT0,
  'ppo_kl_coef': _GE0,
  'dro_beta': (lambda v: v > 0, True, 'a number > 0 (required by dro)'),
  'dppo_delta_low': (_GT0[0], True, 'a number > 0, or None (clip_ratio_low)'),
  'dppo_delta_high': (_GT0[0], True, 'a number > 0, or None (clip_ratio_high)'),
  'dppo_ratio_cap': (_GT0[0], True, 'a number > 0, or None (clip_ratio_c)'),
  'cispo_clip_low': (_GE0[0], True, 'a number >= 0, or None (clip_ratio_low)'),
  'cispo_clip_high': (
    _GE0[0],
    True,
    'a number >= 0, or None (clip_ratio_high)',
  ),
  'prime_mask_low': _GT0,
  'prime_mask_high': _GT0,
  'prime_adv_tau': _ANY,
  'prime_kl_tau': _GE0,
  'm2_budget': _GE0,
  'm2po_miniclip_low': (_GE0[0], True, 'a number >= 0, or None'),
  'm2po_miniclip_high': (_GE0[0], True, 'a number >= 0, or None'),
  'topr_negative_ratio_lower': _GE0,
  'topr_negative_ratio_upper': _GT0,
}

# Spellings of other frameworks (§4.4) -> the jaxcorr knob(s) to use.
_FOREIGN = {
  'clip_ratio': 'clip_ratio_low and clip_ratio_high',
  'eps_clip': 'clip_ratio_low',
  'eps_clip_low': 'clip_ratio_low',
  'eps_clip_high': 'clip_ratio_high',
  'eps_clip_c': 'clip_ratio_c',
  'kl_cov_frac': 'kl_cov_ratio',
  'delta_low': 'dppo_delta_low',
  'delta_high': 'dppo_delta_high',
  'dppo_mask_low': 'prime_mask_low',
  'dppo_mask_high': 'prime_mask_high',
  'adv_tau': 'prime_adv_tau',
  'kl_tau': 'prime_kl_tau',
}


def _suggest(word: str, options) -> str:
  close = difflib.get_close_matches(word, list(options), n=1)
  return f' (did you mean {close[0]!r}?)' if close else ''


def _check_name(name: object) -> str:
  if not isinstance(name, str) or name not in LOSSES:
    hint = _suggest(name, LOSSES) if isinstance(name, str) else ''
    raise ValueError(
      f'unknown policy loss {name!r}{hint}. Valid names: ' + ', '.join(LOSSES)
    )
  return name


def check_knobs(knobs: Mapping[str, object], name: str | None = None) -> None:
  """Validates policy-loss knobs (§4.4); raises ValueError on the first problem.

  Args:
    knobs: knob name -> value; missing knobs take `KNOB_DEFAULTS`.
    name: the policy loss the knobs are for, if known. It is validated, and
      `dro` then requires `dro_beta`.

  Raises:
    ValueError: an unknown knob (the message suggests the closest valid name),
      a value outside the allowed set (naming knob, value and what is
      allowed), `clip_cov_lb >= clip_cov_ub`, or an unknown loss name.
  """
  for key in knobs:
    if key not in KNOB_DEFAULTS:
      hint = (
        f' (use {_FOREIGN[key]})'
        if key in _FOREIGN
        else _suggest(str(key), KNOB_DEFAULTS)
      )
      raise ValueError(
        f'unknown policy-loss knob {key!r}{hint}. Valid knobs: '
        + ', '.join(KNOB_DEFAULTS)
      )
  if name is not None:
    _check_name(name)
  merged = {**KNOB_DEFAULTS, **knobs}
  for key, (ok, none_ok, allowed) in _RULES.items():
    v = merged[key]
    if v is None and none_ok:
      continue
    if not (masked.is_number(v) and ok(v)):
      raise ValueError(
        f'policy-loss knob {key}={v!r} is invalid; allowed: {allowed}'
      )
  lb, ub = merged['clip_cov_lb'], merged['clip_cov_ub']
  if not lb < ub:
    raise ValueError(
      f'policy-loss knobs clip_cov_lb={lb!r}, clip_cov_ub={ub!r} are '
      'invalid; allowed: clip_cov_lb < clip_cov_ub'
    )
  if name == 'dro' and merged['dro_beta'] is None:
    raise ValueError(
      'policy-loss knob dro_beta=None is invalid for dro: '
      'policy_loss.dro_beta must be a positive value when using DRO '
      '(allowed: a number > 0)'
    )


def _prepare(name, logp, old_logp, advantages, mask, is_weights, rollout_logp):
  """Trace-time checks on the arrays (shapes, dtype, presence)."""
  masked.check_mask(mask)
  reads = READS[name]
  if reads == 'old' and name != 'reinforce':
    masked.require(old_logp, 'old_logp', f'by policy loss {name!r}')
  if reads == 'rollout':
    masked.require(rollout_logp, 'rollout_logp', f'by policy loss {name!r}')
  masked.require(logp, 'logp', 'by every policy loss')
  masked.require(advantages, 'advantages', 'by every policy loss')
  if is_weights is not None and not USES_IS_WEIGHTS[name]:
    raise ValueError(
      f'is_weights must be None for policy loss {name!r}: it already divides '
      'by μ, so IS weights would correct twice (allowed: None)'
    )


def policy_loss(
  name: str,
  logp: jax.Array,
  old_logp: jax.Array | None,
  advantages: jax.Array,
  mask: jax.Array,
  *,
  is_weights: jax.Array | None = None,
  agg: str | None = None,
  rollout_logp: jax.Array | None = None,
  num_tokens: float | jax.Array | None = None,
  num_seqs: float | jax.Array | None = None,
  norm: float | jax.Array | None = None,
  key: jax.Array | None = None,
  clip_cov_pick: jax.Array | None = None,
  **knobs: object,
) -> tuple[jax.Array, Metrics]:
  """One policy loss of the registry, aggregated to a scalar.

  `loss = aggregate(ℓ, mask, agg or NATURAL_AGG[name], num_tokens=...,
  num_seqs=..., norm=...)` with ℓ the per-token loss of `LOSSES[name]`.
  Every float input is sanitised with the mask before any arithmetic, and
  only `logp` carries gradient.

  Args:
    name: a key of `LOSSES`.
    logp: `[B, T]` log π_θ of the sampled tokens (differentiated).
    old_logp: `[B, T]` log π_old; required when `READS[name] == 'old'`
      (optional for `reinforce`, which only logs `ppo_kl` from it).
    advantages: `[B, T]` advantages A.
    mask: `[B, T]` bool, the (corrected) loss mask.
    is_weights: optional `[B, T]` IS weights w (not for rollout_is/prime).
    agg: aggregation mode or verl alias; None takes `NATURAL_AGG[name]`.
    rollout_logp: `[B, T]` log μ; required by `rollout_is` and `prime`.
    num_tokens: global token count for `token_mean` (see `aggregate`).
    num_seqs: global non-empty row count for the `seq_mean_*` modes.
    norm: divisor of `seq_mean_token_sum_norm` (None: T).
    key: PRNG key for `clip_cov`'s random draw.
    clip_cov_pick: optional `[B, T]` bool selection replacing the draw (D10).
    **knobs: the knobs of `KNOB_DEFAULTS`, checked by `check_knobs`.

  Returns:
    `(loss, metrics)`: a scalar in the computation dtype (at least float32)
    and a dict of scalar metrics under `actor/`.

  Raises:
    ValueError: at trace time, for an unknown name, knob or aggregation mode,
      an invalid knob value, mismatched shapes, a non-bool mask, a missing
      required array, or `is_weights` given to rollout_is/prime.
  """
  fn = LOSSES[_check_name(name)]
  check_knobs(knobs, name)
  mode = canonical_mode(NATURAL_AGG[name] if agg is None else agg)
  _prepare(name, logp, old_logp, advantages, mask, is_weights, rollout_logp)
  if name == 'clip_cov' and key is None and clip_cov_pick is None:
    raise ValueError(
      "key is required by policy loss 'clip_cov' (a jax.random key for its "
      'random draw), got None; or pass clip_cov_pick'
    )
  if clip_cov_pick is not None:
    masked.check_mask(clip_cov_pick, 'clip_cov_pick')
  masked.check_shapes(
    {
      'logp': logp,
      'old_logp': old_logp,
      'advantages': advantages,
      'mask': mask,
      'is_weights': is_weights,
      'rollout_logp': rollout_logp,
      'clip_cov_pick': clip_cov_pick,
    }
  )
  dtype = masked.float_dtype(
    logp, old_logp, advantages, is_weights, rollout_logp
  )

  def const(v):
    if v is None:
      return None
    return masked.sanitize(jax.lax.stop_gradient(v), mask, dtype)

  x = LossInputs(
    logp=masked.sanitize(logp, mask, dtype),
    old_logp=const(old_logp),
    rollout_logp=const(rollout_logp),
    adv=const(advantages),
    w=const(is_weights),
    mask=mask,
    key=key,
    pick=clip_cov_pick,
  )
  per_token, metrics = fn(x, {**KNOB_DEFAULTS, **knobs})
  loss = aggregate(
    per_token,
    mask,
    mode,
    num_tokens=num_tokens,
    num_seqs=num_seqs,
    norm=norm,
  )
  return loss, metrics
