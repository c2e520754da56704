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
  one divisor; `objective_config.normalizer_kind(cfg)` says which (`'tokens'`,
  `'seqs'` or `'none'` for token_sum). It returns `'mixed'` only when `cfg.agg`
  is None, the policy loss's natural mode is a seq mode (gspo, gspo_seq, sapo,
  geo_mean) and an entropy or KL term is on; then set `agg` explicitly or keep
  one gradient accumulator per divisor. Bypass statistics that are batch-level by design
  (batch normalisation, metrics) cover one call, as in verl
  (docs/math/correction.md §2).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcorr.losses import aggregate as agg_lib
from jaxcorr.losses import correction as corr_lib
from jaxcorr.losses import kl as kl_lib
from jaxcorr.losses import masked
from jaxcorr.losses import policy as policy_lib
from jaxcorr.losses.objective_config import ActorLossConfig, check_compatible


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


def _correct(
  corr_cfg, logp, mask, old_logp, rollout_logp, correction, *, gap, seq_reward
) -> _Corrected:
  """The mask, IS weights and old log-prob of `corr_cfg`'s mode (the table in
  the module docstring); `gap` is `(version_gap, gap_buckets)` or None."""
  if corr_cfg is None or corr_cfg.mode == 'decoupled':
    if gap is not None:
      raise ValueError(
        'version_gap is for the bypass-mode correction only; the decoupled '
        'one takes it on the global batch (jaxcorr/train/prepare.py)'
      )
    if corr_cfg is None:
      return _no_correction(mask, old_logp, correction)
    return _decoupled(corr_cfg, mask, old_logp, correction)
  extra = dict(seq_reward=seq_reward)
  if gap is not None:
    extra.update(version_gap=gap[0], gap_buckets=gap[1])
  return _bypass(
    corr_cfg, logp, mask, old_logp, rollout_logp, correction, extra
  )


def _loss_terms(cfg, c: _Corrected, arrays, counts, *, key):
  """The policy loss on the corrected mask, plus the auxiliary terms and the
  corrected counts (`actor_objective`'s `(loss, metrics)`)."""
  logp, rollout_logp = arrays['logp'], arrays['rollout_logp']
  pg, pg_metrics = policy_lib.policy_loss(
    cfg.policy_loss,
    logp,
    c.old_logp,
    arrays['advantages'],
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
    entropy=arrays['entropy'],
    ref_logp=arrays['ref_logp'],
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
  arrays = dict(
    logp=logp,
    advantages=advantages,
    mask=mask,
    old_logp=old_logp,
    rollout_logp=rollout_logp,
    ref_logp=ref_logp,
    entropy=entropy,
  )
  masked.check_mask(mask)
  masked.check_shapes(arrays)
  c = _correct(
    corr_cfg, logp, mask, old_logp, rollout_logp, correction,
    gap=None if version_gap is None else (version_gap, gap_buckets),
    seq_reward=seq_reward,
  )  # fmt: skip
  counts = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm=norm)
  return _loss_terms(cfg, c, arrays, counts, key=key)
