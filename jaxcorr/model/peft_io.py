"""LoRA adapters to a PEFT directory: `adapter_config.json` +
`adapter_model.safetensors` with PEFT's key names, which
`peft.PeftModel.from_pretrained(base, dir)` loads onto the transformers
base model.

Key names: `base_model.model.model.layers.<i>.self_attn.<q|k|v|o>_proj.
lora_A.weight` (and `mlp.<gate|up|down>_proj`, `lora_B.weight`). PEFT's
`lora_A.weight` is [r, in] and `lora_B.weight` [out, r] (torch `Linear`
layout); ours are A [in, r] and B [r, out] over the flattened HF feature
order (jaxcorr/model/lora.py), so each is written transposed. The scale
alpha / r travels as `r` and `lora_alpha` (`use_rslora` off).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
from flax import nnx

from jaxcorr.model.lora import LoraConfig

ADAPTER_CONFIG = 'adapter_config.json'
ADAPTER_WEIGHTS = 'adapter_model.safetensors'

_HF_PARENT = {'attn': 'self_attn', 'mlp': 'mlp'}


def peft_tensors(adapter: Any) -> dict[str, np.ndarray]:
  """`{PEFT key: float32 array}` of an adapter state (layers listed or
  stacked by `scan_layers`)."""
  pure = (
    nnx.to_pure_dict(adapter) if isinstance(adapter, nnx.State) else adapter
  )
  layers = pure['layers']
  out = {}

  def put(i, parent, name, node):
    prefix = f'base_model.model.model.layers.{i}.{_HF_PARENT[parent]}.{name}'
    a, b = (
      np.asarray(node['lora'][k], np.float32) for k in ('lora_a', 'lora_b')
    )
    out[f'{prefix}.lora_A.weight'] = np.ascontiguousarray(a.T)
    out[f'{prefix}.lora_B.weight'] = np.ascontiguousarray(b.T)

  stacked = not all(isinstance(k, int) for k in layers)
  per_layer = (
    [(None, layers)]
    if stacked
    else sorted(layers.items(), key=lambda kv: kv[0])
  )
  for i, layer in per_layer:
    for parent, mods in layer.items():
      for name, node in mods.items():
        if not stacked:
          put(i, parent, name, node)
          continue
        n = np.asarray(node['lora']['lora_a']).shape[0]
        for j in range(n):
          one = {k: np.asarray(v)[j] for k, v in node['lora'].items()}
          put(j, parent, name, {'lora': one})
  return out


def save_peft(
  adapter: Any, cfg: LoraConfig, out: str, *, base_model: str = ''
) -> None:
  """Writes `adapter` (an adapter `nnx.State` or its pure dict) as a PEFT
  LoRA directory `out` for the base model `base_model` (a path or hub id)."""
  from safetensors.numpy import save_file

  os.makedirs(out, exist_ok=True)
  save_file(peft_tensors(adapter), os.path.join(out, ADAPTER_WEIGHTS))
  config = {
    'peft_type': 'LORA',
    'task_type': 'CAUSAL_LM',
    'base_model_name_or_path': base_model or None,
    'r': cfg.rank,
    'lora_alpha': cfg.alpha,
    'lora_dropout': cfg.dropout,
    'target_modules': list(cfg.target_modules),
    'bias': 'none',
    'fan_in_fan_out': False,
    'use_rslora': False,
    'use_dora': False,
    'init_lora_weights': True,
    'inference_mode': True,
    'modules_to_save': None,
  }
  with open(os.path.join(out, ADAPTER_CONFIG), 'w') as f:
    json.dump(config, f, indent=2)
