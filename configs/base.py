"""Library defaults: every loss and correction field, with a preset on top.

Usage::

  --config=configs/base.py                      # preset 'disabled'
  --config=configs/base.py:decoupled_token_is   # any preset of presets.py
  --config=configs/base.py:bypass_ppo_clip+rollout_kl
  --config.correction.is_lower=0.5 --config.correction.rs=token_k1,seq_max_k3

Sections:

* `correction`: every `CorrectionConfig` field (docs/math/correction.md §3) plus
  `enabled`. `enabled=False` turns the whole correction off
  (`CorrectionConfig | None` is None): no correction runs, no diagnostic is
  logged and no rollout log-prob is needed. This is different from the
  `disabled` preset, which changes nothing in the update but still computes
  every diagnostic, and therefore needs rollout log-probs.
* `actor`: every `ActorLossConfig` field (docs/math/losses.md §4.4 and §5).
* `algorithm`: advantages and KL in reward (`configs/algorithm.py`).
* `model`, `data`, `rollout`, `reward`, `train`, `optim`, `critic`, `mesh`,
  `eval`: the trainer (`configs/trainer.py`, docs/training.md,
  docs/evaluation.md).

The actor section is named `actor` because docs/math/correction.md §6 names
its fields so (`actor.policy_loss`, `actor.rollout_kl_coef` in the preset
table). The critic has its own section (`configs/trainer.py`).

Conventions:

* Every field (name, default, allowed values, doc) is declared once, on its
  frozen dataclass: `CorrectionConfig` (jaxcorr/losses/correction/config.py),
  `ActorLossConfig` and the `PolicyKnobs` it inherits
  (jaxcorr/losses/objective_config.py, jaxcorr/losses/policy/inputs.py), and
  the trainer sections (`configs/trainer.py`). The sections here are derived
  from them (`jaxcorr.config.convert.section`); `correction.enabled` is the
  switch.
* Fields that may be None are typed placeholders
  (`config_dict.placeholder(float)`), so a CLI override such as
  `--config.correction.is_lower=0.5` is parsed with the right type.
* absl parses a float override as a float, so None cannot be typed for a
  float field: `--config.actor.clip_ratio_c=inf` switches the dual clip off
  (the same loss as None); the optional strings `is_level` and `agg` accept
  `none`.
* `correction.rs` and `correction.rs_bounds` are verl's comma-separated
  strings (`'token_k1,seq_max_k3'`, `'0.5_2.0,0.01'`); `''` means none.
* The config is locked: a typo in an override fails instead of adding a key.
* `jaxcorr.train.build.build(config)` turns the sections into the frozen
  dataclasses and runs every validation at start-up.

To extend: add a `setting` to the dataclass that owns the field; its
section here follows. A task config starts from `base_config()`, sets its
own fields, and applies the preset named by its config string the same way
`get_config` does.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_collections

from configs import presets, trainer
from configs.algorithm import algorithm_section
from jaxcorr.config.convert import section
from jaxcorr.losses.correction import CorrectionConfig
from jaxcorr.losses.objective_config import ActorLossConfig


def correction_section() -> ml_collections.ConfigDict:
  """`CorrectionConfig` fields plus `enabled` (docs/math/correction.md §3)."""
  return section(CorrectionConfig, switch=True)


def actor_section() -> ml_collections.ConfigDict:
  """`ActorLossConfig` fields (docs/math/losses.md §4.4, §5)."""
  return section(ActorLossConfig)


def base_config() -> ml_collections.ConfigDict:
  """Every section at the library defaults: unlocked, no preset applied.

  Task configs start from here, add or change their own fields, then call
  `presets.apply_preset(config, config_string)` and `config.lock()`, exactly
  as `get_config` below does.
  """
  config = ml_collections.ConfigDict()
  config.correction = correction_section()
  config.actor = actor_section()
  config.algorithm = algorithm_section()
  config.update(trainer.sections())
  return config


def get_config(
  config_string: str | None = None,
  *,
  task: Callable[[ml_collections.ConfigDict], None] | None = None,
) -> ml_collections.ConfigDict:
  """The base config, then a task config's values (`task(config)`, which
  changes values, never keys), then preset `config_string` (None:
  disabled), locked. Every task config's `get_config` is this with its own
  `task`."""
  config = base_config()
  if task is not None:
    task(config)
  presets.apply_preset(config, config_string)
  config.lock()
  return config
