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

MoE layers: the stacked expert adapters (A [E, in, r], B [E, r, out]) are
written per expert under the HF per-expert module names,
`...layers.<i>.mlp.experts.<e>.gate_proj.lora_A.weight` (Qwen3-MoE,
Qwen2-MoE) or `...layers.<i>.block_sparse_moe.experts.<e>.w1.lora_A.weight`
(Mixtral: w1 / w3 / w2 for gate / up / down), the layout PEFT and vLLM
read; the Qwen2-MoE shared expert is `mlp.shared_expert.<name>`. With
transformers 5 the experts are fused 3-D parameters and PEFT 0.21
converts these per-expert keys when it loads them (docs/lora.md says
what it can and cannot load: `peft_refusal`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcorr.model.config import TransformerConfig
from jaxcorr.model.hf_io import moe_module_names
from jaxcorr.model.lora import MLP, LoraConfig

ADAPTER_CONFIG = 'adapter_config.json'
ADAPTER_WEIGHTS = 'adapter_model.safetensors'

_HF_PARENT = {'attn': 'self_attn', 'mlp': 'mlp'}


def _nodes(tree: Any, path: tuple = ()) -> list[tuple[tuple, dict]]:
  """(path, {'lora_a', 'lora_b'}) of every adapter in a pure dict."""
  if not isinstance(tree, dict):
    return []
  if 'lora' in tree:
    return [(path, tree['lora'])]
  return [n for k, v in tree.items() for n in _nodes(v, (*path, k))]


def _module_names(
  key: tuple, moe: bool, names: dict[str, str]
) -> tuple[str, bool]:
  """(HF module name inside a layer, with `{e}` for an expert; whether
  the arrays carry an expert axis) of an adapter at `key` in a layer."""
  parent, *rest = key
  if parent == 'mlp' and moe and len(rest) == 1:
    return f'{names["moe"]}.experts.{{e}}.{names[rest[0]]}', True
  return '.'.join((_HF_PARENT[parent], *rest)), False


def peft_tensors(
  adapter: Any, model: TransformerConfig | None = None
) -> dict[str, np.ndarray]:
  """`{PEFT key: float32 array}` of an adapter state (layers listed or
  stacked by `scan_layers`). `model` (needed for an MoE policy) says
  which layers are MoE and the family's expert module names."""
  pure = (
    nnx.to_pure_dict(adapter) if isinstance(adapter, nnx.State) else adapter
  )
  layers = pure['layers']
  moe_layers = set(model.moe_layers) if model and model.num_experts else set()
  names = moe_module_names(model.architecture if model else '')
  stacked = not all(isinstance(k, int) for k in layers)
  out = {}

  def put(i, key, a, b):
    module, experts = _module_names(key, i in moe_layers, names)
    if a.ndim != 2 + experts:
      raise ValueError(
        f'adapter {key} of layer {i} has A of shape {a.shape}: stacked '
        'experts need the MoE model config (peft_tensors(..., model=))'
      )
    pairs = zip(a, b) if experts else [(a, b)]
    for e, (ae, be) in enumerate(pairs):
      prefix = f'base_model.model.model.layers.{i}.{module.format(e=e)}'
      out[f'{prefix}.lora_A.weight'] = np.ascontiguousarray(ae.T)
      out[f'{prefix}.lora_B.weight'] = np.ascontiguousarray(be.T)

  for path, node in _nodes(layers):
    a, b = (np.asarray(node[k], np.float32) for k in ('lora_a', 'lora_b'))
    if stacked:
      for i in range(a.shape[0]):
        put(i, path, a[i], b[i])
    else:
      put(path[0], path[1:], a, b)
  return out


def target_modules(
  cfg: LoraConfig, model: TransformerConfig | None = None
) -> list[str]:
  """PEFT `target_modules`: our names, Mixtral's expert names for the MLP
  ones (its MLPs are all MoE)."""
  names = moe_module_names(model.architecture if model else '')
  moe = bool(model and model.num_experts)
  return [names[t] if moe and t in MLP else t for t in cfg.target_modules]


def peft_refusal(
  cfg: LoraConfig, model: TransformerConfig | None
) -> str | None:
  """Why PEFT cannot load this policy's adapters onto the transformers
  model, or None. With transformers >= 5 the experts are one fused
  `gate_up_proj` [E, 2F, D] and one `down_proj` parameter per layer, and
  PEFT 0.21 converts per-expert adapters onto them by retargeting the MLP
  names from modules to those parameters (`target_parameters`), for
  every module of that name (docs/lora.md)."""
  if not (model and model.num_experts):
    return None
  mlp = [t for t in cfg.target_modules if t in MLP]
  if not mlp:
    return None
  if ('gate_proj' in mlp) != ('up_proj' in mlp):
    return (
      'gate_proj and up_proj must be targeted together on an MoE model: '
      "transformers fuses the experts' two into one gate_up_proj parameter "
      'and PEFT converts adapters on both or neither'
    )
  plain = []
  if model.shared_expert_intermediate_size:
    plain.append('the shared expert')
  if len(model.moe_layers) < model.num_layers:
    plain.append('dense MLP layers')
  if plain:
    return (
      f'the MLP targets ({", ".join(mlp)}) also adapt {" and ".join(plain)}, '
      'which PEFT cannot load beside the experts: when it converts the '
      "per-expert adapters to transformers' fused expert parameters it "
      'retargets those names to the experts only and drops the rest'
    )
  return None


def save_peft(
  adapter: Any,
  cfg: LoraConfig,
  out: str,
  *,
  base_model: str = '',
  model: TransformerConfig | None = None,
  dtype: Any = None,
) -> None:
  """Writes `adapter` (an adapter `nnx.State` or its pure dict) as a PEFT
  LoRA directory `out` for the base model `base_model` (a path or hub id);
  `model` is the policy's config (needed for an MoE policy); the tensors
  in `dtype` (None: float32). Raises ValueError where PEFT could not load
  it (`peft_refusal`)."""
  from safetensors.numpy import save_file

  why = peft_refusal(cfg, model)
  if why:
    raise ValueError(
      f'cannot export config.lora.target_modules='
      f'{",".join(cfg.target_modules)} as a PEFT adapter: {why}. Export '
      'the merged model instead (without --adapter), or train with other '
      'targets (docs/lora.md)'
    )
  tensors = peft_tensors(adapter, model)
  if dtype is not None:
    tensors = {k: v.astype(jnp.dtype(dtype)) for k, v in tensors.items()}
  os.makedirs(out, exist_ok=True)
  save_file(tensors, os.path.join(out, ADAPTER_WEIGHTS))
  config = {
    'peft_type': 'LORA',
    'task_type': 'CAUSAL_LM',
    'base_model_name_or_path': base_model or None,
    'r': cfg.rank,
    'lora_alpha': cfg.alpha,
    'lora_dropout': cfg.dropout,
    'target_modules': target_modules(cfg, model),
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
