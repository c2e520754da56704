"""The trainer's config sections: model, data, rollout, reward, train, optim,
critic, mesh.

Each field (name, default, allowed values, doc) is declared once, on its
frozen dataclass in `jaxcorr/train/run_config.py` (`MeshConfig` in
`jaxcorr/sharding.py`); these sections are derived from them.
`configs/base.py` assigns each of them in `base_config`; a task config
(`configs/arith_tiny.py`, `configs/gsm8k_qwen.py`, ...) changes their
values, never their keys. `jaxcorr.config.convert.build` turns them back
into the dataclasses at start-up and validates every field there (a
`ValueError` naming `config.<section>.<field>`, the value and the allowed
values).
"""

from __future__ import annotations

import ml_collections

from jaxcorr.config.convert import section
from jaxcorr.sharding import MeshConfig
from jaxcorr.train import run_config

SECTIONS = {**run_config.SECTIONS, 'mesh': MeshConfig}
"""Section name -> the dataclass that declares its fields."""


def sections() -> dict[str, ml_collections.ConfigDict]:
  """Every trainer section at its defaults."""
  return {name: section(cls) for name, cls in SECTIONS.items()}
