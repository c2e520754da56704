"""The trainer's config sections: model, data, rollout, reward, train, optim,
critic, mesh, eval.

Each field (name, default, allowed values, doc) is declared once, on the
frozen dataclass of its section, beside the code it configures;
`jaxcorr.train.build.SECTIONS` maps each section to its class (`ModelConfig`
in jaxcorr/train/policy.py, `DataConfig` in jaxcorr/data/config.py,
`RolloutConfig` in jaxcorr/train/rollouts/config.py, `RewardConfig` in
jaxcorr/rewards/config.py, `TrainConfig` in jaxcorr/train/run_config.py,
`OptimConfig` in jaxcorr/train/state.py, `CriticConfig` in
jaxcorr/train/critic.py, `MeshConfig` in jaxcorr/sharding.py, `EvalConfig` in
jaxcorr/train/evals/config.py); these
sections are derived from them. `configs/base.py` assigns each of them in
`base_config`; a task config (`configs/arith_tiny.py`,
`configs/gsm8k_qwen.py`, ...) changes their values, never their keys.
`jaxcorr.train.build.build` turns them back into the dataclasses at
start-up and validates every field there (a `ValueError` naming
`config.<section>.<field>`, the value and the allowed values).
"""

from __future__ import annotations

import ml_collections

from jaxcorr.config.convert import section
from jaxcorr.train.build import SECTIONS


def sections() -> dict[str, ml_collections.ConfigDict]:
  """Every trainer section at its defaults."""
  return {name: section(cls) for name, cls in SECTIONS.items()}
