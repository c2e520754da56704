"""The `algorithm` config section: advantages and KL in reward.

Spec `advantages.md` §2, §7, §8. `configs/base.py` assigns
`config.algorithm = algorithm_section()`; `jaxcorr.algorithm_config.build`
turns it into the frozen `AlgorithmConfig` at start-up and validates every
field there (a `ValueError` naming `config.algorithm.<field>`, the value and
the allowed values).

Recipes (advantages.md §5)::

  GRPO       --config.algorithm.estimator=grpo
  Dr.GRPO    --config.algorithm.estimator=grpo
             --config.algorithm.norm_adv_by_std=false
             --config.actor.agg=seq_mean_token_sum_norm
  PPO        --config.critic.enabled=true --config.algorithm.estimator=gae
             --config.algorithm.gamma=1.0 --config.algorithm.lam=0.95
  KL reward  --config.algorithm.kl_in_reward.enabled=true
             --config.algorithm.kl_in_reward.type=adaptive
             --config.algorithm.kl_penalty=low_var_kl
"""

from __future__ import annotations

import ml_collections


def kl_in_reward_section() -> ml_collections.ConfigDict:
  """`KLControlConfig` fields plus `enabled` (verl defaults, §8)."""
  k = ml_collections.ConfigDict()
  # False: no KL in reward (AlgorithmConfig.kl_in_reward is None).
  k.enabled = False
  # Controller: 'fixed' (β constant) or 'adaptive' (β steered to target_kl).
  k.type = 'fixed'
  # Initial β >= 0 of token_rewards = scores − β·kl.
  k.kl_coef = 0.001
  # adaptive: the per-token KL to steer to (> 0).
  k.target_kl = 0.1
  # adaptive: sequences over which β moves by up to a factor e^{±0.2} (> 0;
  # at start-up 0.2·batch_size/horizon must stay below 1).
  k.horizon = 10000
  return k


def algorithm_section() -> ml_collections.ConfigDict:
  """`AdvantageConfig` fields, the KL-in-reward estimator and controller."""
  a = ml_collections.ConfigDict()
  # Advantage estimator: gae, grpo, rloo, reinforce_plus_plus,
  # reinforce_plus_plus_baseline, remax, opo, gpg, grpo_passk, maxrl.
  a.estimator = 'grpo'
  # Discount γ in [0, 1] (gae, reinforce_plus_plus).
  a.gamma = 1.0
  # GAE λ in [0, 1] (gae).
  a.lam = 1.0
  # Divide by the group std (grpo, grpo_passk); False with grpo = Dr.GRPO.
  a.norm_adv_by_std = True
  # ε >= 0 added to the group std (grpo, grpo_passk) or mean (maxrl).
  a.eps = 1e-6
  # KL-in-reward estimator: kl (k1), abs, mse (k2), low_var_kl (k3), or any
  # of them with a trailing + (losses.md §3).
  a.kl_penalty = 'kl'
  # KL in reward and its controller; enabled=False turns it off.
  a.kl_in_reward = kl_in_reward_section()
  return a
