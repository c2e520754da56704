"""The actor objective: policy loss + entropy + ref-KL + rollout-KL (losses.md §5).

`actor_objective` builds the scalar the actor minimises on one mini-batch (or
one micro-batch, with global normalisers). Which log-prob plays which role
depends on the correction config (correction.md §2), all of it static:

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
  recipe (losses.md §2): accumulate numerators and counts, divide once at the
  end. With `actor_objective` this is done with *unit normalisers*: call it
  with `num_tokens=1, num_seqs=1`; every aggregated term is then its
  numerator, exactly what `aggregate_terms` returns, and the count of the
  same micro-batch is `metrics['actor/loss_token_count']` (token modes) or
  `metrics['actor/loss_seq_count']` (seq modes), taken on the corrected mask
  and without gradient. Sum the unit-normalised losses, their gradients and
  the counts over the micro-batches, then divide the loss and the gradient
  by the summed count (`aggregate.finalize`). Because the count carries no
  gradient, this equals the mini-batch call exactly.
  This needs every active term to share one divisor; `normalizer_kind(cfg)`
  says which (`'tokens'`, `'seqs'` or `'none'` for token_sum). It returns
  `'mixed'` only when `cfg.agg` is None, the policy loss's natural mode is a
  seq mode (gspo, gspo_seq, sapo, geo_mean) and an entropy or KL term is on;
  then set `agg` explicitly or keep one gradient accumulator per divisor.
  Bypass statistics that are batch-level by design (batch normalisation,
  metrics) cover one call, as in verl (correction.md §2).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxcorr.losses import aggregate as agg_lib
from jaxcorr.losses import correction as corr_lib
from jaxcorr.losses import kl as kl_lib
from jaxcorr.losses import masked
from jaxcorr.losses import policy as policy_lib


def _check_coef(name: str, value: Any, *, nonneg: bool) -> None:
  allowed = 'a finite number >= 0' if nonneg else 'a finite number'
  if not masked.is_number(value) or not math.isfinite(value):
    raise ValueError(f'{name}={value!r} is invalid; allowed: {allowed}')
  if nonneg and value < 0:
    raise ValueError(f'{name}={value!r} is invalid; allowed: {allowed}')


@dataclasses.dataclass(frozen=True)
class ActorLossConfig:
  """Static configuration of the actor objective (losses.md §5).

  Hashable, so it can be a static jit argument. Validated when built: the
  loss name, `agg` (stored canonical, `token-mean` -> `token_mean`), every
  knob (`policy.check_knobs`), the KL estimator names (stored canonical,
  `low_var_kl` -> `k3`) and the coefficients. A coefficient of 0 turns its
  term off. verl's `use_kl_loss=True, kl_loss_coef=c` is `kl_loss_coef=c`.
  """

  policy_loss: str = 'vanilla'
  agg: str | None = None
  # Policy-loss knobs (losses.md §4.4); None means "fall back" as documented.
  clip_ratio_low: float = 0.2
  clip_ratio_high: float = 0.2
  clip_ratio_c: float | None = 3.0
  tau_pos: float = 1.0
  tau_neg: float = 1.05
  clip_cov_ratio: float = 2e-4
  clip_cov_lb: float = 1.0
  clip_cov_ub: float = 5.0
  kl_cov_ratio: float = 2e-4
  ppo_kl_coef: float = 0.1
  dro_beta: float | None = None
  dppo_delta_low: float | None = None
  dppo_delta_high: float | None = None
  dppo_ratio_cap: float | None = None
  cispo_clip_low: float | None = None
  cispo_clip_high: float | None = None
  prime_mask_low: float = 0.2
  prime_mask_high: float = 0.2
  prime_adv_tau: float = 1.0
  prime_kl_tau: float = 1e-3
  m2_budget: float = 0.04
  m2po_miniclip_low: float | None = None
  m2po_miniclip_high: float | None = None
  topr_negative_ratio_lower: float = 0.0
  topr_negative_ratio_upper: float = 1.0
  # Auxiliary terms.
  entropy_coeff: float = 0.0
  kl_loss_type: str = 'low_var_kl'
  kl_loss_coef: float = 0.0
  rollout_kl_type: str = 'k2'
  rollout_kl_coef: float = 0.0

  def __post_init__(self):
    if self.policy_loss not in policy_lib.LOSSES:
      raise ValueError(
        f'policy_loss={self.policy_loss!r} is not a policy loss; allowed: '
        + ', '.join(sorted(policy_lib.LOSSES))
      )
    if self.agg is not None:
      object.__setattr__(self, 'agg', agg_lib.canonical_mode(self.agg, 'agg'))
    for name in ('kl_loss_type', 'rollout_kl_type'):
      canon = kl_lib.canonical_estimator(getattr(self, name), name)
      object.__setattr__(self, name, canon)
    _check_coef('entropy_coeff', self.entropy_coeff, nonneg=False)
    _check_coef('kl_loss_coef', self.kl_loss_coef, nonneg=True)
    _check_coef('rollout_kl_coef', self.rollout_kl_coef, nonneg=True)
    policy_lib.check_knobs(self.knobs, name=self.policy_loss)

  @property
  def knobs(self) -> dict[str, Any]:
    """The policy-loss knobs, as keyword arguments of `policy_loss`."""
    return {k: getattr(self, k) for k in KNOB_FIELDS}


KNOB_FIELDS: tuple[str, ...] = tuple(
  f.name
  for f in dataclasses.fields(ActorLossConfig)
  if f.name
  not in (
    'policy_loss',
    'agg',
    'entropy_coeff',
    'kl_loss_type',
    'kl_loss_coef',
    'rollout_kl_type',
    'rollout_kl_coef',
  )
)
"""The `ActorLossConfig` fields that are policy-loss knobs (losses.md §4.4)."""


# ------------------------------------------------------- combination checks


def allowed_policy_losses(corr_cfg: corr_lib.CorrectionConfig | None) -> tuple:
  """The policy losses allowed with `corr_cfg` (correction.md §2)."""
  names = tuple(sorted(policy_lib.LOSSES))
  if corr_cfg is None or corr_cfg.mode == 'decoupled':
    return names
  if corr_cfg.bypass_loss == 'reinforce':
    return ('reinforce',)
  return tuple(n for n in names if n != 'reinforce')


def check_compatible(
  actor_cfg: ActorLossConfig,
  corr_cfg: corr_lib.CorrectionConfig | None,
  *,
  rollout_logp_available: bool = True,
) -> None:
  """Start-up checks of an actor config against a correction config.

  Raises ValueError naming the field, the value and what is allowed when

  * the policy loss is not allowed in the correction's mode: bypass +
    `ppo_clip` takes any loss but `reinforce`, bypass + `reinforce` takes
    only `reinforce`, decoupled takes any (correction.md §2);
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
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The actor loss of one (mini- or micro-) batch (losses.md §5).

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

  Returns:
    `(loss, metrics)`: a scalar and a dict of scalars whose keys depend only
    on the static configuration and on which optional arrays are given.
  """
  check_compatible(cfg, corr_cfg)
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
  name = cfg.policy_loss
  reads = policy_lib.READS[name]
  metrics: dict[str, jax.Array] = {}

  if corr_cfg is None:
    if correction is not None:
      raise ValueError(
        'correction was given but corr_cfg is None; pass the CorrectionConfig '
        'it was computed with, or correction=None'
      )
    m, w = mask, None
  elif corr_cfg.mode == 'decoupled':
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
    m = jnp.logical_and(mask, correction.mask)
    w = correction.weights if corr_cfg.is_level is not None else None
  else:  # bypass
    if correction is not None or old_logp is not None:
      given = 'correction' if correction is not None else 'old_logp'
      raise ValueError(
        f'{given} must be None in bypass mode: the correction runs inside the '
        'objective on stop_gradient(logp) and old_logp is rollout_logp'
      )
    masked.require(rollout_logp, 'rollout_logp', 'in bypass mode')
    corr = corr_lib.rollout_correction(
      jax.lax.stop_gradient(logp), rollout_logp, mask, corr_cfg
    )
    metrics.update(corr.metrics)
    m = corr.mask
    old_logp = rollout_logp
    use_w = (
      corr_cfg.bypass_loss == 'reinforce' and corr_cfg.is_level is not None
    )
    w = corr.weights if use_w else None

  if reads == 'old' and name != 'reinforce':  # reinforce: metric only
    masked.require(old_logp, 'old_logp', f'by policy_loss={name!r}')
  if reads == 'rollout':
    masked.require(rollout_logp, 'rollout_logp', f'by policy_loss={name!r}')

  counts = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm=norm)
  pg, pg_metrics = policy_lib.policy_loss(
    name,
    logp,
    old_logp,
    advantages,
    m,
    is_weights=w,
    agg=cfg.agg,
    rollout_logp=rollout_logp,
    key=key,
    **counts,
    **cfg.knobs,
  )
  loss = pg
  metrics['actor/pg_loss'] = pg
  agg_aux = cfg.agg or 'token_mean'

  if cfg.entropy_coeff != 0:
    masked.require(
      entropy, 'entropy', f'when entropy_coeff={cfg.entropy_coeff}'
    )
  if entropy is not None:
    ent = agg_lib.aggregate(entropy, m, agg_aux, **counts)
    metrics['actor/entropy'] = ent
    if cfg.entropy_coeff != 0:
      loss = loss - cfg.entropy_coeff * ent

  if cfg.kl_loss_coef != 0:
    masked.require(
      ref_logp, 'ref_logp', f'when kl_loss_coef={cfg.kl_loss_coef}'
    )
    per_tok = kl_lib.kl_penalty(logp, ref_logp, cfg.kl_loss_type, mask=m)
    kref = agg_lib.aggregate(per_tok, m, agg_aux, **counts)
    loss = loss + cfg.kl_loss_coef * kref
    metrics['actor/kl_loss'] = kref
    metrics['actor/kl_coef'] = jnp.asarray(cfg.kl_loss_coef, kref.dtype)

  if cfg.rollout_kl_coef != 0:
    masked.require(
      rollout_logp,
      'rollout_logp',
      f'when rollout_kl_coef={cfg.rollout_kl_coef}',
    )
    per_tok = kl_lib.kl_penalty(logp, rollout_logp, cfg.rollout_kl_type, mask=m)
    krol = agg_lib.aggregate(per_tok, m, agg_aux, **counts)
    loss = loss + cfg.rollout_kl_coef * krol
    metrics['actor/rollout_kl_loss'] = krol
    metrics['actor/rollout_kl_coef'] = jnp.asarray(
      cfg.rollout_kl_coef, krol.dtype
    )

  tok, seq = loss_normalizers(m)
  metrics['actor/loss_token_count'] = tok
  metrics['actor/loss_seq_count'] = seq
  metrics.update(pg_metrics)
  return loss, metrics
