"""The shapes `python -m jaxcorr.plan` knows by name: model presets (the
`config.model` fields of a scratch model of that shape, so no weights or
config.json are needed), the `--mesh` syntax, and the HBM of each TPU chip.
"""

from __future__ import annotations

import math

from jaxcorr.sharding import MESH_AXES, MeshConfig

MODELS: dict[str, dict[str, object]] = {
  # meta-llama/Llama-3.1-8B(-Instruct) config.json.
  'llama3_8b': dict(
    vocab_size=128_256,
    hidden_size=4096,
    intermediate_size=14_336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    tie_embeddings=False,
    rope_theta=500_000.0,
    max_position_embeddings=131_072,
  ),
  # meta-llama/Llama-3.1-70B(-Instruct) config.json.
  'llama3_70b': dict(
    vocab_size=128_256,
    hidden_size=8192,
    intermediate_size=28_672,
    num_layers=80,
    num_heads=64,
    num_kv_heads=8,
    tie_embeddings=False,
    rope_theta=500_000.0,
    max_position_embeddings=131_072,
  ),
  # Qwen/Qwen3-30B-A3B config.json as a scratch (Mixtral-shaped) model:
  # 48 layers of 128 experts (top 8) of width 768, 32 query / 4 KV heads.
  # A scratch model derives head_dim = hidden / heads = 64 (Qwen3: 128)
  # and has no q/k norm: 30.1B params against 30.5B.
  'qwen3_30b_a3b': dict(
    architecture='MixtralForCausalLM',
    vocab_size=151_936,
    hidden_size=2048,
    intermediate_size=768,
    num_layers=48,
    num_heads=32,
    num_kv_heads=4,
    num_experts=128,
    num_experts_per_tok=8,
    tie_embeddings=False,
    rope_theta=1_000_000.0,
    max_position_embeddings=40_960,
  ),
  # HuggingFaceTB/SmolLM2-135M(-Instruct) config.json.
  'smollm2_135m': dict(
    vocab_size=49_152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    tie_embeddings=True,
    rope_theta=100_000.0,
    max_position_embeddings=8192,
  ),
}
"""`config.model` overrides (with `hf_path=''`) per preset name."""

GIB = 1 << 30

HBM_BYTES: dict[str, int] = {
  'v4': 32 * GIB,
  'v5e': 16 * GIB,
  'v5p': 95 * GIB,
  'v6e': 32 * GIB,
}
"""HBM per chip (cloud.google.com/tpu/docs: v4, v5e, v5p, v6e)."""


def chip_hbm(chips: list[str]) -> dict[str, int]:
  """`--chip` names -> their HBM bytes; ValueError naming the known chips
  (checked before anything compiles)."""
  unknown = [c for c in chips if c not in HBM_BYTES]
  if unknown or not chips:
    raise ValueError(
      f'--chip={",".join(chips)}: unknown chip {", ".join(unknown) or "(none)"}'
      f'; allowed: a comma-separated list of {", ".join(HBM_BYTES)}'
    )
  return {c: HBM_BYTES[c] for c in chips}


CHIPS_PER_HOST = 4
"""Chips per host of a multi-host v4 / v5p / v5e / v6e slice: what each
process's engine samples on (jaxcorr/train/setup.py `make_meshes`)."""


def parse_mesh(text: str) -> tuple[MeshConfig, int]:
  """'fsdp:64' or 'data:2,fsdp:16,tensor:2' -> (MeshConfig, devices);
  unnamed axes are 1."""
  sizes = dict.fromkeys(MESH_AXES, 1)
  for part in filter(None, text.split(',')):
    name, _, value = part.partition(':')
    if name not in sizes or not value.isdigit() or int(value) < 1:
      raise ValueError(
        f'--mesh={text!r}: each part must be axis:size with axis in '
        f'{MESH_AXES} and size >= 1, e.g. fsdp:64 or data:2,fsdp:32'
      )
    sizes[name] = int(value)
  return MeshConfig(**sizes), math.prod(sizes.values())
