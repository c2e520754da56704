"""The actor objective: policy loss + entropy + ref-KL + rollout-KL
(docs/math/losses.md §5).

`actor_objective` builds the scalar the actor minimises on one mini-batch (or
one micro-batch, with global normalisers). Which log-prob plays which role
depends on the correction config (docs/math/correction.md §2), all of it static:

=================  ===============================  ==========  ============
corr_cfg           mask m                           old_logp    IS weights w
=================  ===============================  ==========  ============
None               `mask`                           given       None
decoupled          precomputed `correction.mask`    π_old       `correction.weights` if `is_level`
bypass             the correction run here on       μ (the      its weights only for
                   `sg(logp)` vs `rollout_logp`     rollout)    `reinforce` with `is_level`
=================  ===============================  ==========  ============

Every term uses the same corrected mask m and the same normalisers, so a
rejected token is absent from the pg, entropy, ref-KL and rollout-KL terms and
from every count (D5)::

  loss = pg − entropy_coeff·H + kl_loss_coef·Kref + rollout_kl_coef·Krol

IS weights multiply the pg term only (verl). The entropy and KL terms use
`agg_aux = cfg.agg or 'token_mean'` (verl's `loss_agg_mode` default).

Normalisers and micro-batching
------------------------------
`num_tokens` and `num_seqs` are counts over the whole mini-batch (every device
and every micro-batch), taken on the *corrected* mask (D5). Under jit the
arrays are global, so a single call on the mini-batch needs none of them.

* Decoupled mode (or no correction): the corrected mask is known before the
  forward pass. Compute `loss_normalizers(correction.mask)` on the mini-batch
  and pass both counts to every micro-batch call; the micro-batch losses and
  gradients then sum to the mini-batch ones.
* Bypass mode with rejection (RS or veto): the mask depends on π_θ, so it is
  only known after each micro-batch's forward pass. Use the `aggregate_terms`
  recipe (docs/math/losses.md §2): accumulate numerators and counts, divide once
  at the end. With `actor_objective` this is done with *unit normalisers*: call
  it with `num_tokens=1, num_seqs=1`; every aggregated term is then its
  numerator, exactly what `aggregate_terms` returns, and the count of the same
  micro-batch is `metrics['actor/loss_token_count']` (token modes) or
  `metrics['actor/loss_seq_count']` (seq modes), taken on the corrected mask and
  without gradient. Sum the unit-normalised losses, their gradients and the
  counts over the micro-batches, then divide the loss and the gradient by the
  summed count (`aggregate.finalize`). Because the count carries no gradient,
  this equals the mini-batch call exactly. This needs every active term to share
  one divisor; `normalizer_kind(cfg)` says which (`'tokens'`, `'seqs'` or
  `'none'` for token_sum). It returns `'mixed'` only when `cfg.agg` is None, the
  policy loss's natural mode is a seq mode (gspo, gspo_seq, sapo, geo_mean) and
  an entropy or KL term is on; then set `agg` explicitly or keep one gradient
  accumulator per divisor. Bypass statistics that are batch-level by design
  (batch normalisation, metrics) cover one call, as in verl
  (docs/math/correction.md §2).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcorr.config.fields import canonical, number, setting
from jaxcorr.losses import aggregate as agg_lib
from jaxcorr.losses import correction as corr_lib
from jaxcorr.losses import kl as kl_lib
from jaxcorr.losses import masked
from jaxcorr.losses import policy as policy_lib
from jaxcorr.losses.policy_base import KNOB_FIELDS, PolicyKnobs, validate_knobs


def _policy_loss_name(value: object, path: str) -> str:
  if not isinstance(value, str) or value not in policy_lib.LOSSES:
    raise ValueError(
      f'{path}={value!r} is not a policy loss; allowed: '
      + ', '.join(sorted(policy_lib.LOSSES))
    )
  return value


def _optional_agg(value: object, path: str) -> str | None:
  return None if value is None else agg_lib.canonical_mode(value, path)


@dataclasses.dataclass(frozen=True)
class ActorLossConfig(PolicyKnobs):
  """Static configuration of the actor objective (docs/math/losses.md §5).

  The loss name, its aggregation, every `PolicyKnobs` field (inherited: a
  knob is declared once) and the auxiliary terms. Hashable, so it can be a
  static jit argument. Validated when built: `agg` and the KL estimators
  are stored canonical (`token-mean` -> `token_mean`, `low_var_kl` -> `k3`).
  A coefficient of 0 turns its term off. verl's `use_kl_loss=True,
  kl_loss_coef=c` is `kl_loss_coef=c`.
  """

  policy_loss: str = setting(
    'vanilla',
    _policy_loss_name,
    'Policy loss (docs/math/losses.md §4.2): '
    + ', '.join(policy_lib.LOSSES)
    + '.',
  )
  agg: str | None = setting(
    None,
    _optional_agg,
    'Aggregation: token_mean, token_sum, seq_mean_token_sum, '
    "seq_mean_token_mean, seq_mean_token_sum_norm (or verl's hyphenated "
    "form); None (CLI: none) is the loss's natural mode, and token_mean for "
    'the entropy and KL terms.',
  )
  entropy_coeff: float = setting(
    0.0,
    number(),
    'Entropy bonus: loss −= entropy_coeff · H (needs the entropy array).',
  )
  kl_loss_type: str = setting(
    'low_var_kl',
    canonical(kl_lib.canonical_estimator),
    'Reference-KL estimator: k1 (kl), abs, k2 (mse), k3 (low_var_kl), or '
    "any of them with a trailing + (its value, k2's gradient).",
  )
  kl_loss_coef: float = setting(
    0.0,
    number(0),
    'Reference-KL coefficient (>= 0); 0 turns the term off.',
  )
  rollout_kl_type: str = setting(
    'k2',
    canonical(kl_lib.canonical_estimator),
    'Rollout-KL estimator; k2 is ½(log π_θ − log μ)² (docs/math/losses.md §6).',
  )
  rollout_kl_coef: float = setting(
    0.0,
    number(0),
    'Rollout-KL coefficient (>= 0); 0 turns the term off.',
  )

  def __post_init__(self):
    path = validate_knobs(self)
    policy_lib.check_required(self.policy_loss, self, path)

  @functools.cached_property
  def knobs(self) -> PolicyKnobs:
    """The policy-loss knobs, typed, for `policy_loss(..., knobs=...)`."""
    return PolicyKnobs(**{k: getattr(self, k) for k in KNOB_FIELDS})


class LossConfigs(NamedTuple):
  """The validated, static loss configuration of a run."""

  actor: ActorLossConfig
  correction: corr_lib.CorrectionConfig | None


# ------------------------------------------------------- combination checks


def allowed_policy_losses(corr_cfg: corr_lib.CorrectionConfig | None) -> tuple:
  """The policy losses allowed with `corr_cfg` (docs/math/correction.md §2)."""
  names = tuple(sorted(policy_lib.LOSSES))
  if corr_cfg is None or corr_cfg.mode == 'decoupled':
    return names
  if corr_cfg.bypass_loss == 'reinforce':
    return ('reinforce',)
  return tuple(n for n in names if n != 'reinforce')


@functools.cache
def check_compatible(
  actor_cfg: ActorLossConfig,
  corr_cfg: corr_lib.CorrectionConfig | None,
  *,
  rollout_logp_available: bool = True,
) -> None:
  """Start-up checks of an actor config against a correction config.

  Cached: a valid pair is checked once (when the run's loss configs are
  built), and `actor_objective`'s call on every trace is a cache hit.

  Raises ValueError naming the field, the value and what is allowed when

  * the policy loss is not allowed in the correction's mode: bypass +
    `ppo_clip` takes any loss but `reinforce`, bypass + `reinforce` takes
    only `reinforce`, decoupled takes any (docs/math/correction.md §2);
  * `rollout_is` or `prime` (which already divide by μ) meet an `is_level`;
  * rollout log-probs are needed but the engine does not report them: any
    correction config, a policy loss that reads `rollout_logp`, or a
    rollout-KL term.

  Bypass + `reinforce` with neither IS weights nor rejection nor veto is
  *allowed*: it is plain REINFORCE on the rollout samples with the
  correction's diagnostics, the bypass counterpart of the `disabled` preset
  (and what verl runs for `loss_type='reinforce', rollout_is=None`). It is a
  correct on-policy gradient as long as μ ≈ π_θ; the diagnostics say when
  that stops being true.
  """
  name = actor_cfg.policy_loss
  allowed = allowed_policy_losses(corr_cfg)
  if name not in allowed:
    mode = f'mode={corr_cfg.mode!r}, bypass_loss={corr_cfg.bypass_loss!r}'
    raise ValueError(
      f'actor.policy_loss={name!r} is not allowed with correction {mode}; '
      f'allowed: {", ".join(allowed)}'
    )
  has_weights = corr_cfg is not None and corr_cfg.is_level is not None
  if has_weights and not policy_lib.USES_IS_WEIGHTS[name]:
    raise ValueError(
      f'correction.is_level={corr_cfg.is_level!r} is not allowed with '
      f'actor.policy_loss={name!r}, which already divides by the rollout '
      'probability; allowed: is_level=None'
    )
  if not rollout_logp_available:
    if corr_cfg is not None:
      raise ValueError(
        'correction is set but the rollout engine does not report log-probs '
        '(rollout_logp_available=False); allowed: correction=None, or an '
        'engine that returns rollout log-probs'
      )
    if policy_lib.READS[name] == 'rollout':
      raise ValueError(
        f'actor.policy_loss={name!r} reads rollout log-probs, which the '
        'engine does not report; allowed without them: '
        + ', '.join(
          n
          for n in sorted(policy_lib.LOSSES)
          if policy_lib.READS[n] != 'rollout'
        )
      )
    if actor_cfg.rollout_kl_coef != 0:
      raise ValueError(
        f'actor.rollout_kl_coef={actor_cfg.rollout_kl_coef!r} needs rollout '
        'log-probs, which the engine does not report; allowed: 0.0'
      )


# ---------------------------------------------------------------- normalisers


def natural_agg(cfg: ActorLossConfig) -> str:
  """The aggregation mode the pg term uses: `cfg.agg` or the loss's own."""
  return cfg.agg or agg_lib.canonical_mode(
    policy_lib.NATURAL_AGG[cfg.policy_loss]
  )


def _kind(mode: str) -> str:
  if mode == 'token_sum':
    return 'none'
  return 'tokens' if mode == 'token_mean' else 'seqs'


def normalizer_kind(cfg: ActorLossConfig) -> str:
  """Which global count divides the objective of `cfg`.

  'tokens' (token_mean), 'seqs' (the seq_mean_* modes) or 'none'
  (token_sum, no division) when every active term shares it; 'mixed' when
  the pg term and an active entropy/KL term divide by different counts (see
  the module docstring).
  """
  kinds = {_kind(natural_agg(cfg))}
  aux_on = cfg.entropy_coeff != 0 or cfg.kl_loss_coef != 0
  if aux_on or cfg.rollout_kl_coef != 0:
    kinds.add(_kind(cfg.agg or 'token_mean'))
  return kinds.pop() if len(kinds) == 1 else 'mixed'


def loss_normalizers(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(num_tokens, num_seqs)` of a mini-batch, from its corrected mask (D5).

  Call it on the whole mini-batch's corrected mask (decoupled:
  `correction.mask`; no correction: the response mask) before splitting it
  into micro-batches, and pass both counts to every `actor_objective` call.
  Under jit the mask is global, so the counts cover every device.
  """
  masked.check_mask(mask)
  num_tokens = masked.count(mask)
  num_seqs = jnp.sum(jnp.any(mask, axis=-1), dtype=num_tokens.dtype)
  return num_tokens, num_seqs


# ------------------------------------------------------------ the objective


class _Corrected(NamedTuple):
  """The corrected mask m, the IS weights w (or None) and the log-prob the
  policy loss compares against, plus the bypass correction's metrics."""

  mask: jax.Array
  weights: jax.Array | None
  old_logp: jax.Array | None
  metrics: dict[str, jax.Array]


def _no_correction(mask, old_logp, correction) -> _Corrected:
  if correction is not None:
    raise ValueError(
      'correction was given but corr_cfg is None; pass the CorrectionConfig '
      'it was computed with, or correction=None'
    )
  return _Corrected(mask, None, old_logp, {})


def _decoupled(corr_cfg, mask, old_logp, correction) -> _Corrected:
  """The correction was computed once on the global batch (π_old vs μ)."""
  if correction is None:
    raise ValueError(
      'correction is required in decoupled mode: run rollout_correction('
      'old_logp, rollout_logp, mask, corr_cfg) once on the global batch '
      'and pass its (sliced) result'
    )
  masked.check_mask(correction.mask, 'correction.mask')
  masked.check_shapes(
    {
      'mask': mask,
      'correction.mask': correction.mask,
      'correction.weights': correction.weights,
    }
  )
  weights = correction.weights if corr_cfg.is_level is not None else None
  return _Corrected(
    jnp.logical_and(mask, correction.mask), weights, old_logp, {}
  )


def _bypass(corr_cfg, logp, mask, old_logp, rollout_logp, correction, extra):
  """The correction runs here on sg(logp) vs μ, and μ plays π_old."""
  if correction is not None or old_logp is not None:
    given = 'correction' if correction is not None else 'old_logp'
    raise ValueError(
      f'{given} must be None in bypass mode: the correction runs inside the '
      'objective on stop_gradient(logp) and old_logp is rollout_logp'
    )
  masked.require(rollout_logp, 'rollout_logp', 'in bypass mode')
  corr = corr_lib.rollout_correction(
    jax.lax.stop_gradient(logp), rollout_logp, mask, corr_cfg, **extra
  )
  use_w = corr_cfg.bypass_loss == 'reinforce' and corr_cfg.is_level is not None
  weights = corr.weights if use_w else None
  return _Corrected(corr.mask, weights, rollout_logp, dict(corr.metrics))


def _aux_terms(cfg, loss, logp, m, counts, *, entropy, ref_logp, rollout_logp):
  """`loss − entropy_coeff·H + kl_loss_coef·Kref + rollout_kl_coef·Krol` on
  the corrected mask, aggregated with `cfg.agg or 'token_mean'`."""
  agg_aux = cfg.agg or 'token_mean'
  metrics: dict[str, jax.Array] = {}
  if cfg.entropy_coeff != 0:
    masked.require(
      entropy, 'entropy', f'when entropy_coeff={cfg.entropy_coeff}'
    )
  if entropy is not None:
    ent = agg_lib.aggregate(entropy, m, agg_aux, **counts)
    metrics['actor/entropy'] = ent
    if cfg.entropy_coeff != 0:
      loss = loss - cfg.entropy_coeff * ent
  kl_terms = (
    ('kl', 'ref_logp', ref_logp, cfg.kl_loss_type, cfg.kl_loss_coef),
    (
      'rollout_kl',
      'rollout_logp',
      rollout_logp,
      cfg.rollout_kl_type,
      cfg.rollout_kl_coef,
    ),
  )
  for name, arg, other, estimator, coef in kl_terms:
    if coef == 0:
      continue
    coef_name = 'kl_loss_coef' if name == 'kl' else 'rollout_kl_coef'
    masked.require(other, arg, f'when {coef_name}={coef}')
    per_tok = kl_lib.kl_penalty(logp, other, estimator, mask=m)
    term = agg_lib.aggregate(per_tok, m, agg_aux, **counts)
    loss = loss + coef * term
    metrics[f'actor/{name}_loss'] = term
    metrics[f'actor/{name}_coef'] = jnp.asarray(coef, term.dtype)
  return loss, metrics


def actor_objective(
  cfg: ActorLossConfig,
  corr_cfg: corr_lib.CorrectionConfig | None,
  *,
  logp: jax.Array,
  advantages: jax.Array,
  mask: jax.Array,
  old_logp: jax.Array | None = None,
  rollout_logp: jax.Array | None = None,
  ref_logp: jax.Array | None = None,
  entropy: jax.Array | None = None,
  correction: corr_lib.Correction | None = None,
  num_tokens: float | jax.Array | None = None,
  num_seqs: float | jax.Array | None = None,
  norm: float | jax.Array | None = None,
  key: jax.Array | None = None,
  version_gap: jax.Array | None = None,
  gap_buckets: int = 4,
  seq_reward: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The actor loss of one (mini- or micro-) batch (docs/math/losses.md §5).

  Args:
    cfg: the actor loss configuration (static).
    corr_cfg: the correction configuration (static), or None for none.
    logp: `[B, T]` log π_θ of the sampled tokens; the only log-prob that
      carries gradient.
    advantages: `[B, T]` advantages (constant).
    mask: `[B, T]` bool response mask *before* rejection.
    old_logp: `[B, T]` log π_old. Required when the policy loss reads it
      and `corr_cfg` is None or decoupled. Must be None in bypass mode,
      where `rollout_logp` takes its place.
    rollout_logp: `[B, T]` log μ. Required in bypass mode, by a policy loss
      that reads it, and by a rollout-KL term.
    ref_logp: `[B, T]` log π_ref; required when `kl_loss_coef != 0`.
    entropy: `[B, T]` per-token entropy of π_θ over the vocabulary at the
      sampling temperature; required when `entropy_coeff != 0`, logged when
      given.
    correction: decoupled mode only: the `Correction` computed once on the
      global batch (sliced to this batch). Must be None otherwise.
    num_tokens: global count of corrected-mask tokens (see
      `loss_normalizers`); None means this batch's own.
    num_seqs: global count of non-empty corrected rows; None: this batch's.
    norm: divisor of `seq_mean_token_sum_norm` (the trainer passes
      `rollout.max_new_tokens`); None means the padded length T.
    key: PRNG key, required by `clip_cov`.
    version_gap, gap_buckets: bypass mode only: the `rollout_correction`
      arguments of its per-version-gap metrics (async training).
    seq_reward: optional `[B]` sequence rewards, for the bypass
      correction's masked-correct metric (`rollout_correction`).

  Returns:
    `(loss, metrics)`: a scalar and a dict of scalars whose keys depend only
    on the static configuration and on which optional arrays are given.
  """
  check_compatible(cfg, corr_cfg)  # cached: checked once per config pair
  masked.check_mask(mask)
  masked.check_shapes(
    {
      'logp': logp,
      'advantages': advantages,
      'mask': mask,
      'old_logp': old_logp,
      'rollout_logp': rollout_logp,
      'ref_logp': ref_logp,
      'entropy': entropy,
    }
  )
  gap = {}
  if version_gap is not None:
    if corr_cfg is None or corr_cfg.mode == 'decoupled':
      raise ValueError(
        'version_gap is for the bypass-mode correction only; the decoupled '
        'one takes it on the global batch (jaxcorr/train/prepare.py)'
      )
    gap = dict(version_gap=version_gap, gap_buckets=gap_buckets)
  if corr_cfg is None:
    c = _no_correction(mask, old_logp, correction)
  elif corr_cfg.mode == 'decoupled':
    c = _decoupled(corr_cfg, mask, old_logp, correction)
  else:
    c = _bypass(
      corr_cfg, logp, mask, old_logp, rollout_logp, correction,
      dict(gap, seq_reward=seq_reward),
    )  # fmt: skip

  counts = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm=norm)
  pg, pg_metrics = policy_lib.policy_loss(
    cfg.policy_loss,
    logp,
    c.old_logp,
    advantages,
    c.mask,
    is_weights=c.weights,
    agg=cfg.agg,
    rollout_logp=rollout_logp,
    key=key,
    knobs=cfg.knobs,
    **counts,
  )
  loss, aux_metrics = _aux_terms(
    cfg,
    pg,
    logp,
    c.mask,
    counts,
    entropy=entropy,
    ref_logp=ref_logp,
    rollout_logp=rollout_logp,
  )
  tok, seq = loss_normalizers(c.mask)
  metrics = {
    **c.metrics,
    'actor/pg_loss': pg,
    **aux_metrics,
    'actor/loss_token_count': tok,
    'actor/loss_seq_count': seq,
    **pg_metrics,
  }
  return loss, metrics
