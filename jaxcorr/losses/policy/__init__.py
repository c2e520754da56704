"""The policy losses: one registry, one calling convention
(docs/math/losses.md §4).

The package face: callers use the names of `__all__` from here,

    from jaxcorr.losses import policy
    knobs = policy.check_knobs({'clip_ratio_high': 0.28}, 'vanilla')
    loss, metrics = policy.policy_loss(
      'vanilla', logp, old_logp, advantages, mask, knobs=knobs
    )

and any other name from the module that defines it:

  registry  the `LOSSES` registry, its views, the knob checks and the
            dispatcher `policy_loss`
  inputs    `LossInputs` and `PolicyKnobs`, the two arguments of every loss
            `fn(x: LossInputs, k: PolicyKnobs) -> (ℓ, metrics)`, and the
            accessors the losses share
  ratio     trust-region surrogates of the ratio ρ (PPO clip and its sequence
            forms, sapo, clip_cov, kl_cov, DPPO anchored at π_old or μ, m2po)
  logprob   `−c·A·logp` losses (gpg, reinforce, dro, rollout_is, prime,
            cispo anchored at π_old or μ, topr)
"""

from jaxcorr.losses.policy.inputs import KNOB_FIELDS, LossInputs, PolicyKnobs
from jaxcorr.losses.policy.registry import (
  DEFAULT_KNOBS,
  LOSSES,
  NATURAL_AGG,
  READS,
  USES_IS_WEIGHTS,
  check_knobs,
  policy_loss,
)

__all__ = [
  'DEFAULT_KNOBS',
  'KNOB_FIELDS',
  'LOSSES',
  'NATURAL_AGG',
  'READS',
  'USES_IS_WEIGHTS',
  'LossInputs',
  'PolicyKnobs',
  'check_knobs',
  'policy_loss',
]
