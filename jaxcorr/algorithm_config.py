"""`config.algorithm` (ml-collections) -> the frozen `AlgorithmConfig`.

Called once at start-up, like `jaxcorr.loss_config.build`. Every check that
does not depend on array values runs here (D7), with a `ValueError` naming
`config.algorithm.<field>` (or `config.algorithm.kl_in_reward.<field>`), the
value and the allowed values:

* `AdvantageConfig`: the estimator name, γ and λ in [0, 1], a bool
  `norm_adv_by_std`, ε ≥ 0;
* `kl_penalty`: a KL estimator of `jaxcorr.losses.kl`;
* `KLControlConfig`: `fixed`/`adaptive`, β ≥ 0, and for `adaptive` a
  positive target and horizon;
* unknown keys (a typo that bypassed the locked config).

`check_startup` adds the checks that need the batch geometry: `grpo_passk`
needs at least 2 samples per prompt, and the adaptive controller needs
`0.2·batch_size/horizon < 1` (docs/math/advantages.md §4, §8).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from jaxcorr import config_sections
from jaxcorr.losses import kl as kl_lib
from jaxcorr.losses.advantages import AdvantageConfig
from jaxcorr.losses.rewards import KLControlConfig, check_kl_horizon

SECTION = 'config.algorithm'
KL_SECTION = 'config.algorithm.kl_in_reward'


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
  """The validated, static algorithm configuration of a run.

  Attributes:
    advantage: estimator and knobs for `compute_advantages`.
    kl_in_reward: the controller config, or None when KL in reward is off.
    kl_penalty: the canonical KL estimator of `apply_kl_penalty` (`k1`, ...).
  """

  advantage: AdvantageConfig = dataclasses.field(
    default_factory=AdvantageConfig
  )
  kl_in_reward: KLControlConfig | None = None
  kl_penalty: str = 'k1'


def kl_control_config(section: Any) -> KLControlConfig | None:
  """The `KLControlConfig` of a `kl_in_reward` section; None when off."""
  values = config_sections.values(section)
  config_sections.check_keys(
    KL_SECTION, values, ('enabled', *config_sections.fields(KLControlConfig))
  )
  enabled = values.pop('enabled', False)
  if not isinstance(enabled, bool):
    raise ValueError(
      f'{KL_SECTION}.enabled: invalid value {enabled!r}; allowed: True, False'
    )
  if not enabled:
    return None
  return config_sections.construct(KLControlConfig, KL_SECTION, values)


def build(config: Any) -> AlgorithmConfig:
  """Validates `config.algorithm` (or the section itself) at start-up.

  Args:
    config: the run's ConfigDict with an `algorithm` section, or that
      section (a ConfigDict or a plain dict).

  Raises:
    ValueError: naming `config.algorithm.<field>`, the value and the allowed
      values.
  """
  section = config
  if isinstance(config, ml_collections.ConfigDict) and isinstance(
    config.get('algorithm'), ml_collections.ConfigDict
  ):
    section = config.algorithm
  values = config_sections.values(section)
  adv_fields = config_sections.fields(AdvantageConfig)
  config_sections.check_keys(
    SECTION, values, (*adv_fields, 'kl_penalty', 'kl_in_reward')
  )
  advantage = config_sections.construct(
    AdvantageConfig,
    SECTION,
    {k: v for k, v in values.items() if k in adv_fields},
  )
  kl_penalty = kl_lib.canonical_estimator(
    values.get('kl_penalty', 'kl'), field=f'{SECTION}.kl_penalty'
  )
  kl_ctrl = kl_control_config(values.get('kl_in_reward', {}))
  return AlgorithmConfig(
    advantage=advantage, kl_in_reward=kl_ctrl, kl_penalty=kl_penalty
  )


def check_startup(
  cfg: AlgorithmConfig, *, batch_size: int, samples_per_prompt: int
) -> None:
  """Checks that need the batch geometry (host validator, start-up).

  Args:
    cfg: the built algorithm config.
    batch_size: sequences per training batch (the controller's `n_steps`).
    samples_per_prompt: rollouts per prompt (the group size).

  Raises:
    ValueError: `grpo_passk` with fewer than 2 samples per prompt, or an
      adaptive horizon with `0.2·batch_size/horizon >= 1`.
  """
  if cfg.advantage.estimator == 'grpo_passk' and samples_per_prompt < 2:
    raise ValueError(
      f"{SECTION}.estimator: 'grpo_passk' needs samples_per_prompt >= 2, got "
      f'{samples_per_prompt}; allowed: another estimator, or >= 2 samples'
    )
  if cfg.kl_in_reward is not None:
    try:
      check_kl_horizon(cfg.kl_in_reward, batch_size)
    except ValueError as e:
      raise ValueError(
        str(e).replace('KLControlConfig.', f'{KL_SECTION}.', 1)
      ) from e
