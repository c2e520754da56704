"""The policy-loss registry and its dispatcher (docs/math/losses.md §4).

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

For stale and μ-anchored data (formulas in their docstrings):

=============  =====================================================  =======
name           ℓ                                                      anchor
=============  =====================================================  =======
cispo_rollout  −sg(clip(ρ_μ, 1−κ_l, 1+κ_h))·A·logp                   μ
dppo_mu_tv     −A·ρ_μ·valid_tv (ratio differentiated, no cap)         μ
dppo_mu_kl     −A·ρ_μ·valid_kl                                        μ
m2po           max(−Aρ, −A·clip(ρ, e^−τ, e^τ))·w, τ batch-global      π_old
topr           −A·logp·sg(t_i)·w, t_i = 1 if Ā_i ≥ 0 else clip(ρ̄_i)   π_old
=============  =====================================================  =======

The formulas live in `jaxcorr.losses.policy.ratio` (trust-region surrogates
of the ratio) and `jaxcorr.losses.policy.logprob` (`−c·A·logp`), the inputs
and knobs in `jaxcorr.losses.policy.inputs`; this module holds the registry
(one `PolicyLoss` entry per loss), the knob checks of a mapping and the
dispatcher that checks, promotes, sanitises and stop-gradients the inputs,
then calls every loss the same way, `fn(LossInputs, PolicyKnobs)`.

Adding a loss: its function `(LossInputs, PolicyKnobs) -> (ℓ, metrics)` in
`ratio` or `logprob`, one `LOSSES` entry here (natural aggregation, which
log-prob it reads, whether it takes IS weights or a PRNG key, required
knobs), and each new knob as one `setting` of `PolicyKnobs`. `config.actor`,
`ActorLossConfig`, validation and the error messages follow from those.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping

import jax

from jaxcorr.losses import masked
from jaxcorr.losses.aggregate import aggregate, canonical_mode
from jaxcorr.losses.policy import logprob, ratio
from jaxcorr.losses.policy.inputs import (
  KNOB_FIELDS,
  LossFn,
  LossInputs,
  Metrics,
  PolicyKnobs,
)

_TM, _SM = 'token_mean', 'seq_mean_token_mean'


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
  """One registry entry: the per-token function and what it needs.

  Attributes:
    fn: `(LossInputs, PolicyKnobs) -> (ℓ [B, T], metrics)`.
    natural_agg: the aggregation used when `agg=None` (an explicit agg
      always wins, D9).
    reads: the second log-prob it reads: 'old' (`old_logp`), 'rollout'
      (`rollout_logp`; `old_logp` is ignored) or None.
    read_required: False where the loss only logs a metric from the
      log-prob it reads (`reinforce`'s `ppo_kl`), so it may be None.
    uses_is_weights: False where the loss already divides by μ, so passing
      IS weights is an error.
    needs_key: the loss draws random numbers (`clip_cov`): a PRNG `key`,
      or the injected `clip_cov_pick`, is required.
    requires: `(knob, why)` for each knob (a positive number) that must not
      be None for this loss; checked when the actor config is built and on
      every `policy_loss` call.
  """

  fn: LossFn
  natural_agg: str = _TM
  reads: str | None = 'old'
  read_required: bool = True
  uses_is_weights: bool = True
  needs_key: bool = False
  requires: tuple[tuple[str, str], ...] = ()


# μ-anchored: reads rollout_logp and already divides by μ.
_MU = dict(reads='rollout', uses_is_weights=False)
LOSSES: dict[str, PolicyLoss] = {
  'vanilla': PolicyLoss(ratio.vanilla),
  'gspo': PolicyLoss(ratio.gspo, natural_agg=_SM),
  'gspo_seq': PolicyLoss(ratio.gspo_seq, natural_agg=_SM),
  'sapo': PolicyLoss(ratio.sapo, natural_agg=_SM),
  'gpg': PolicyLoss(logprob.gpg, reads=None),
  'cispo': PolicyLoss(logprob.cispo),
  'clip_cov': PolicyLoss(ratio.clip_cov, needs_key=True),
  'kl_cov': PolicyLoss(ratio.kl_cov),
  'geo_mean': PolicyLoss(ratio.geo_mean, natural_agg=_SM),
  'dro': PolicyLoss(
    logprob.dro,
    # verl's own message, which its callers match on.
    requires=(
      (
        'dro_beta',
        'policy_loss.dro_beta must be a positive value when using DRO',
      ),
    ),
  ),
  'dppo_tv': PolicyLoss(ratio.dppo_tv),
  'dppo_kl': PolicyLoss(ratio.dppo_kl),
  'reinforce': PolicyLoss(logprob.reinforce, read_required=False),
  'rollout_is': PolicyLoss(logprob.rollout_is, **_MU),
  'prime': PolicyLoss(logprob.prime, **_MU),
  # Stale and μ-anchored data.
  'cispo_rollout': PolicyLoss(logprob.cispo_rollout, **_MU),
  'dppo_mu_tv': PolicyLoss(ratio.dppo_mu_tv, **_MU),
  'dppo_mu_kl': PolicyLoss(ratio.dppo_mu_kl, **_MU),
  'm2po': PolicyLoss(ratio.m2po),
  'topr': PolicyLoss(logprob.topr, natural_agg=_SM),
}
"""The registry: name -> `PolicyLoss`. Adding a loss is one entry here (its
function in `ratio` or `logprob`) plus any new knob as one `setting` of
`PolicyKnobs`; configs, validation and `ActorLossConfig` follow."""

NATURAL_AGG: dict[str, str] = {n: e.natural_agg for n, e in LOSSES.items()}
READS: dict[str, str | None] = {n: e.reads for n, e in LOSSES.items()}
USES_IS_WEIGHTS: dict[str, bool] = {
  n: e.uses_is_weights for n, e in LOSSES.items()
}
"""Views of the registry, by field."""

DEFAULT_KNOBS = PolicyKnobs()

# Spellings of other frameworks (docs/math/losses.md §4.4) -> the jaxcorr
# knob(s) to use.
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


def check_name(name: object) -> str:
  """`name` if it is a registered policy loss, else ValueError."""
  if not isinstance(name, str) or name not in LOSSES:
    hint = _suggest(name, LOSSES) if isinstance(name, str) else ''
    raise ValueError(
      f'unknown policy loss {name!r}{hint}. Valid names: ' + ', '.join(LOSSES)
    )
  return name


def check_required(name: str, knobs: PolicyKnobs, path: str) -> None:
  """The knobs loss `name` requires are set (`dro` needs `dro_beta`)."""
  for knob, why in LOSSES[name].requires:
    if getattr(knobs, knob) is None:
      raise ValueError(
        f'{path}.{knob}=None is invalid for {name}: {why} (allowed: a '
        'number > 0)'
      )


def check_knobs(
  knobs: Mapping[str, object], name: str | None = None
) -> PolicyKnobs:
  """The typed `PolicyKnobs` of a mapping (docs/math/losses.md §4.4), validated.

  Args:
    knobs: knob name -> value; missing knobs take their defaults.
    name: the policy loss the knobs are for, if known. It is validated, and
      its required knobs (`dro`: `dro_beta`) must be set.

  Raises:
    ValueError: an unknown knob (the message suggests the closest valid name
      or the jaxcorr spelling of another framework's), a value outside the
      allowed set (naming knob, value and what is allowed),
      `clip_cov_lb >= clip_cov_ub`, or an unknown loss name.
  """
  for key in knobs:
    if key not in KNOB_FIELDS:
      hint = (
        f' (use {_FOREIGN[key]})'
        if key in _FOREIGN
        else _suggest(str(key), KNOB_FIELDS)
      )
      raise ValueError(
        f'unknown policy-loss knob {key!r}{hint}. Valid knobs: '
        + ', '.join(KNOB_FIELDS)
      )
  typed = PolicyKnobs(**knobs)
  if name is not None:
    check_required(check_name(name), typed, 'PolicyKnobs')
  return typed


def _prepare(
  name, logp, old_logp, advantages, mask, is_weights, rollout_logp, key, pick
):
  """Trace-time checks on the arrays (shapes, dtype, presence)."""
  masked.check_mask(mask)
  entry = LOSSES[name]
  read = {
    'old': ('old_logp', old_logp),
    'rollout': ('rollout_logp', rollout_logp),
  }
  if entry.reads is not None and entry.read_required:
    arg, value = read[entry.reads]
    masked.require(value, arg, f'by policy loss {name!r}')
  masked.require(logp, 'logp', 'by every policy loss')
  masked.require(advantages, 'advantages', 'by every policy loss')
  if is_weights is not None and not entry.uses_is_weights:
    raise ValueError(
      f'is_weights must be None for policy loss {name!r}: it already divides '
      'by μ, so IS weights would correct twice (allowed: None)'
    )
  if entry.needs_key and key is None and pick is None:
    raise ValueError(
      f'key is required by policy loss {name!r} (a jax.random key for its '
      'random draw), got None; or pass clip_cov_pick'
    )
  if pick is not None:
    masked.check_mask(pick, 'clip_cov_pick')
  masked.check_shapes(
    {
      'logp': logp,
      'old_logp': old_logp,
      'advantages': advantages,
      'mask': mask,
      'is_weights': is_weights,
      'rollout_logp': rollout_logp,
      'clip_cov_pick': pick,
    }
  )


def _sanitized_inputs(
  logp, old_logp, advantages, mask, is_weights, rollout_logp, key, pick
) -> LossInputs:
  """The `LossInputs` of a loss: every float zeroed off the mask in one
  computation dtype, and only `logp` left differentiable."""
  dtype = masked.float_dtype(
    logp, old_logp, advantages, is_weights, rollout_logp
  )

  def const(v):
    if v is None:
      return None
    return masked.sanitize(jax.lax.stop_gradient(v), mask, dtype)

  return LossInputs(
    logp=masked.sanitize(logp, mask, dtype),
    old_logp=const(old_logp),
    rollout_logp=const(rollout_logp),
    adv=const(advantages),
    w=const(is_weights),
    mask=mask,
    key=key,
    pick=pick,
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
  knobs: PolicyKnobs = DEFAULT_KNOBS,
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
    knobs: the typed knobs (validated when built; `check_knobs` builds them
      from a mapping).

  Returns:
    `(loss, metrics)`: a scalar in the computation dtype (at least float32)
    and a dict of scalar metrics under `actor/`.

  Raises:
    ValueError: at trace time, for an unknown name or aggregation mode, a
      required knob left None, mismatched shapes, a non-bool mask, a missing
      required array, or `is_weights` given to rollout_is/prime.
  """
  fn = LOSSES[check_name(name)].fn
  check_required(name, knobs, 'knobs')
  mode = canonical_mode(NATURAL_AGG[name] if agg is None else agg)
  arrays = (logp, old_logp, advantages, mask, is_weights, rollout_logp)
  _prepare(name, *arrays, key, clip_cov_pick)
  x = _sanitized_inputs(*arrays, key, clip_cov_pick)
  per_token, metrics = fn(x, knobs)
  loss = aggregate(
    per_token,
    mask,
    mode,
    num_tokens=num_tokens,
    num_seqs=num_seqs,
    norm=norm,
  )
  return loss, metrics
