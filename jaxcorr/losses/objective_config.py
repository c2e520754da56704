"""The actor objective's static configuration and its start-up checks
(docs/math/losses.md §5).

`ActorLossConfig` (the loss, its aggregation, its knobs and the auxiliary
terms), the combination checks against a `CorrectionConfig`
(docs/math/correction.md §2), and which global count divides the objective
(`normalizer_kind`, used by the micro-batching recipe in
jaxcorr/losses/objective.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

from jaxcorr.config.fields import canonical, number, setting
from jaxcorr.losses import aggregate as agg_lib
from jaxcorr.losses import correction as corr_lib
from jaxcorr.losses import kl as kl_lib
from jaxcorr.losses import policy as policy_lib
from jaxcorr.losses.policy import KNOB_FIELDS, PolicyKnobs
from jaxcorr.losses.policy.inputs import validate_knobs
from jaxcorr.losses.policy.registry import check_required
from jaxcorr.losses.vcpo import VCPOKnobs, check_vcpo


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
class ActorLossConfig(PolicyKnobs, VCPOKnobs):
  """Static configuration of the actor objective (docs/math/losses.md §5).

  The loss name, its aggregation, every `PolicyKnobs` field (inherited: a
  knob is declared once), VCPO's step scaling and baseline (`VCPOKnobs`,
  jaxcorr/losses/vcpo.py) and the auxiliary terms. Hashable, so it can be a
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
    check_required(self.policy_loss, self, path)

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
    rollout-KL term;
  * VCPO (`ess_scaling`, `grad_baselining`) without IS weights: it needs
    the decoupled correction with an `is_level` (`vcpo.check_vcpo`).

  Bypass + `reinforce` with neither IS weights nor rejection nor veto is
  *allowed*: it is plain REINFORCE on the rollout samples with the
  correction's diagnostics, the bypass counterpart of the `disabled` preset
  (and what verl runs for `loss_type='reinforce', rollout_is=None`). It is a
  correct on-policy gradient as long as μ ≈ π_θ; the diagnostics say when
  that stops being true.
  """
  check_vcpo(actor_cfg, corr_cfg)
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
