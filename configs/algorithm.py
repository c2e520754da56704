"""The `algorithm` config section: advantages and KL in reward.

`docs/math/advantages.md` §2, §7, §8. The fields are declared once, on
`AdvantageConfig` (`jaxcorr/losses/advantages.py`), `KLControlConfig`
(`jaxcorr/losses/rewards.py`) and `AlgorithmConfig.kl_penalty`
(`jaxcorr/train/run_config.py`); `configs/base.py` assigns
`config.algorithm = algorithm_section()`, and `jaxcorr.train.build.algorithm`
turns it back into the frozen `AlgorithmConfig` at start-up (a `ValueError`
naming `config.algorithm.<field>`, the value and the allowed values).

Recipes (docs/math/advantages.md §5)::

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

from jaxcorr.config.convert import section
from jaxcorr.losses.advantages import AdvantageConfig
from jaxcorr.losses.rewards import KLControlConfig
from jaxcorr.train.run_config import AlgorithmConfig


def algorithm_section() -> ml_collections.ConfigDict:
  """`config.algorithm`: the `AdvantageConfig` fields, `kl_penalty`, and the
  `kl_in_reward` section (`KLControlConfig` plus its switch, off)."""
  out = section(AdvantageConfig)
  out.update(section(AlgorithmConfig))
  out.kl_in_reward = section(KLControlConfig, switch=False)
  return out
