"""The settings a parity report compares, one entry each.

A `Setting` is config overrides on top of a model's config, or its own
config file where the setting is a model of its own (MoE, the multi-turn
tool task). `apply(setting, config)` gives the run's ConfigDict; a setting
that names a field the config does not have fails in one line.

The docs plan (`docs_plan`, `--all`): each setting on SmolLM2-135M where
it applies and the converted checkpoint is there (`make smollm2`), else
on the embedded tiny model of its config file.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import ml_collections

F32, BF16 = 'float32', 'bfloat16'


@dataclasses.dataclass(frozen=True)
class Setting:
  """name: the CLI's and the table's name; what: one line for the table;
  overrides: (dotted field, value) pairs; config: a config of its own
  (`configs/<config>.py`) or None (the model's); smollm2: it applies to
  SmolLM2 (a dense Llama) as overrides."""

  name: str
  what: str
  overrides: tuple[tuple[str, Any], ...] = ()
  config: str | None = None
  smollm2: bool = True


def _dtypes(engine: str, trainer: str) -> tuple[tuple[str, Any], ...]:
  return (('rollout.engine_dtype', engine), ('model.dtype', trainer))


_BF16_ENGINE = _dtypes(BF16, F32)

SETTINGS: tuple[Setting, ...] = (
  Setting('fp32', 'engine and trainer float32', _dtypes(F32, F32)),
  Setting('bf16', 'engine and trainer bfloat16', _dtypes(BF16, BF16)),
  Setting('bf16_engine', 'bfloat16 engine, float32 trainer', _BF16_ENGINE),
  Setting(
    'int8',
    'int8 weights (bf16 engine), float32 trainer',
    (*_BF16_ENGINE, ('rollout.quantization', 'int8')),
  ),
  Setting(
    'fp8',
    'fp8 e4m3 weights (bf16 engine), float32 trainer',
    (*_BF16_ENGINE, ('rollout.quantization', 'fp8')),
  ),
  Setting(
    'kv_int8',
    'int8 KV cache (bf16 engine), float32 trainer',
    (*_BF16_ENGINE, ('rollout.kv_cache_dtype', 'int8')),
  ),
  Setting(
    'moe',
    'MoE (8 experts, top 2), bf16 engine, trainer routes itself',
    (('moe.router_replay', 'none'),),
    config='arith_moe',
    smollm2=False,
  ),
  Setting(
    'moe_r3',
    "MoE, bf16 engine, trainer replays the engine's routing (R3)",
    (('moe.router_replay', 'rollout'),),
    config='arith_moe',
    smollm2=False,
  ),
  Setting(
    'lora',
    'LoRA rank 8 on attention, random B (merged engine), float32',
    (*_dtypes(F32, F32), ('lora.rank', 8), ('lora.alpha', 16.0)),
  ),
  Setting(
    'multi_turn',
    'multi-turn tool calls (calculator), KV continuation, float32',
    _dtypes(F32, F32),
    config='arith_tool',
    smollm2=False,
  ),
  Setting(
    'exact',
    'exact mode (rollout.exact), engine and trainer bfloat16',
    (*_dtypes(BF16, BF16), ('rollout.exact', True)),
  ),
)
"""Every setting, in table order."""

TINY = 'arith_tiny'
SMOLLM2 = 'smollm2_arith'


def by_name(names: list[str] | tuple[str, ...]) -> list[Setting]:
  """The settings `names`; ValueError naming the allowed ones."""
  known = {s.name: s for s in SETTINGS}
  bad = [n for n in names if n not in known]
  if bad:
    raise ValueError(
      f'--settings: unknown {", ".join(bad)}; allowed: {", ".join(known)}'
    )
  return [known[n] for n in names]


def load_config(name: str, config_string: str | None = None):
  """`configs/<name>.py`'s `get_config(config_string)`."""
  module = importlib.import_module(f'configs.{name}')
  return module.get_config(config_string)


def apply(
  setting: Setting, config: ml_collections.ConfigDict
) -> ml_collections.ConfigDict:
  """A copy of `config` with the setting's overrides; ValueError when a
  field does not exist."""
  config = config.copy_and_resolve_references()
  for path, value in setting.overrides:
    *parents, leaf = path.split('.')
    node = config
    for p in parents:
      node = node[p]
    if leaf not in node:
      raise ValueError(
        f'setting {setting.name!r}: the config has no field config.{path}'
      )
    with node.unlocked():
      node[leaf] = value
  return config
