"""The run's policy model: the `model` config section and the model built
from it.

    ModelConfig ─ transformer_config ─ TransformerConfig (scratch or HF)
                └ build_policy ─ Policy (module, graphdef, param shardings)

`transformer_config` is the one mapping from the section to the model's
`TransformerConfig`: `build_policy` initialises a scratch policy from it
(and loads a HF one with the same options, `_hf_options`), and
`jaxcorr.export` rebuilds the same shapes from a run's config.json with it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from absl import logging
from flax import nnx

from jaxcorr import sharding
from jaxcorr.config.fields import (
  boolean,
  fail,
  integer,
  number,
  one_of,
  setting,
  text,
  validate,
)
from jaxcorr.model import (
  REMAT_MODES,
  Transformer,
  TransformerConfig,
  attention,
  load_hf,
)
from jaxcorr.model.attention import ATTENTION, allowed
from jaxcorr.model.lora import LoraConfig, apply_lora
from jaxcorr.train import mixed_precision
from jaxcorr.train.mixed_precision import COMPUTE_DTYPES, PARAM_DTYPES

_POS, _NAT = integer(1), integer(0)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The policy: a local Hugging Face checkpoint or a model from scratch.

  The shape fields (vocab_size ... initializer_range) build a scratch model
  and are ignored with `hf_path`; every field `TransformerConfig` shares is
  passed on by name (`transformer_config`).
  """

  hf_path: str = setting(
    '',
    text,
    'Local HF directory (config.json, *.safetensors, tokenizer.json); '
    "'' builds a randomly initialised model from the shape fields.",
  )
  vocab_size: int = setting(32, _POS, 'Scratch model: vocabulary size.')
  hidden_size: int = setting(128, _POS, 'Scratch model: width.')
  intermediate_size: int = setting(384, _POS, 'Scratch model: MLP width.')
  num_layers: int = setting(2, _POS, 'Scratch model: decoder layers.')
  num_heads: int = setting(4, _POS, 'Scratch model: query heads.')
  num_kv_heads: int = setting(2, _POS, 'Scratch model: KV heads (GQA).')
  tie_embeddings: bool = setting(
    True, boolean, 'Scratch model: the LM head reuses the embedding.'
  )
  rope_theta: float = setting(
    10_000.0, number(0, lo_open=True), 'Scratch model: RoPE base.'
  )
  max_position_embeddings: int = setting(
    512, _POS, 'Scratch model: longest sequence (prompt + response).'
  )
  initializer_range: float = setting(
    0.02, number(0, lo_open=True), 'Std of the random init (scratch models).'
  )
  dtype: str = setting(
    'auto',
    mixed_precision.dtype_rule(*COMPUTE_DTYPES),
    "Trainer compute dtype: 'auto' is float32 on CPU, bfloat16 on GPU and "
    'TPU (over float32 master weights); log-probs are always float32 '
    '(docs/precision.md, "Mixed-precision training").',
  )
  param_dtype: str = setting(
    'float32',
    mixed_precision.dtype_rule(*PARAM_DTYPES),
    'Stored parameter dtype of the policy (float32: master weights and '
    'optimizer state).',
  )
  remat: str = setting(
    'none',
    one_of('none', 'full', 'dots'),
    "Activation checkpointing. With scan_layers, 'dots' is usually the "
    'fastest too: a scan writes each saved residual into an [L, ...] '
    'buffer, and recomputing the elementwise work costs less '
    '(docs/models.md).',
  )
  scan_layers: bool = setting(
    False, boolean, 'Scan over layers (one layer compiled once; long models).'
  )
  logprob_chunk: int = setting(
    128, _POS, 'Positions per chunk of the chunked log-prob computation.'
  )
  logprob_remat: str = setting(
    'auto',
    one_of(*REMAT_MODES),
    "The update's log-prob chunks: recompute each chunk's [B, c, V] logits "
    "in the backward pass ('always'), keep them ('never') or keep them "
    "while one micro-batch's logits fit REMAT_AUTO_BYTES ('auto'); same "
    'values and gradients (jaxcorr/model/logprobs.py).',
  )
  init_seed: int = setting(0, _NAT, 'Seed of the random init.')
  # A scratch model is a plain decoder (no biases, no q/k norm): Llama, or
  # Mixtral's mixture of experts (docs/moe.md); HF checkpoints bring their own.
  architecture: str = setting(
    'LlamaForCausalLM',
    one_of('LlamaForCausalLM', 'MixtralForCausalLM'),
    'Scratch model: the HF family (Mixtral: every MLP is an MoE block).',
  )
  num_experts: int = setting(
    0, _NAT, 'Scratch MoE model: experts per layer (0 for Llama).'
  )
  num_experts_per_tok: int = setting(
    0, _NAT, 'Scratch MoE model: experts each token is routed to (top-k).'
  )
  attention: str = setting(
    'jnp',
    one_of(*ATTENTION),
    "Attention: 'jnp' (the reference, CPU), 'xla' / 'cudnn' "
    "(jax.nn.dot_product_attention), 'splash' (Pallas TPU kernel), "
    "'splash_interpret' (the same kernel interpreted: tests), 'auto' (by "
    'backend); checked against the backend at start-up (docs/architecture.md).',
  )
  moe_dispatch: str = setting(
    'grouped',
    one_of('grouped', 'dense'),
    "MoE dispatch: 'grouped' (ragged_dot over tokens sorted by expert) or "
    "'dense' (every expert on every token: the test reference).",
  )

  def __post_init__(self):
    path = validate(self)
    if not self.hf_path:
      # The model's own shape rules (top-k against the experts, heads, ...)
      # at config time; its messages start with `field=value`.
      try:  # shapes only: no backend asked for dtype='auto'
        transformer_config(self, backend='cpu')
      except ValueError as e:
        raise ValueError(f'{path}.{e}') from None


def _hf_options(
  model: ModelConfig, backend: str | None = None
) -> dict[str, Any]:
  """The section's fields that apply to a HF checkpoint's config."""
  return dict(
    param_dtype=model.param_dtype,
    dtype=mixed_precision.compute_dtype(model.dtype, backend),
    remat=model.remat,
    scan_layers=model.scan_layers,
    attention=model.attention,
  )


def transformer_config(
  model: ModelConfig, backend: str | None = None
) -> TransformerConfig:
  """The policy's `TransformerConfig`: `hf_path`'s config.json with this
  section's dtypes, remat and scan_layers, or, for a scratch model, every
  `config.model` field that `TransformerConfig` also has, by name.
  `dtype='auto'` is resolved for `backend` (None: the running one, which
  this then starts: `mixed_precision.compute_dtype`)."""
  if model.hf_path:
    options = _hf_options(model, backend)
    return TransformerConfig.from_hf_config(model.hf_path, **options)
  shared = TransformerConfig.__dataclass_fields__
  fields = {k: v for k, v in vars(model).items() if k in shared}
  fields['dtype'] = mixed_precision.compute_dtype(model.dtype, backend)
  if model.num_experts:  # Mixtral: one MLP width, every layer MoE
    fields['moe_intermediate_size'] = model.intermediate_size
  return TransformerConfig(**fields)


def check_attention(model: ModelConfig, engine_dtype: str, backend: str):
  """`model.attention` against `backend` and the compute dtypes of the
  trainer and the engine (`jaxcorr.model.attention.refusal`); at start-up,
  once the backend may be asked (after `jax.distributed`)."""
  dtypes = (mixed_precision.compute_dtype(model.dtype, backend), engine_dtype)
  why = attention.refusal(model.attention, backend, dtypes)
  if why:
    fail('config.model.attention', model.attention, allowed(backend), why)


@dataclasses.dataclass
class Policy:
  """The policy module, its split form and its parameter shardings."""

  module: Transformer
  config: TransformerConfig
  graphdef: Any
  param_shardings: Any


def build_policy(
  model: ModelConfig, mesh: jax.sharding.Mesh, lora: LoraConfig | None = None
) -> Policy:
  """The policy on `mesh`: `hf_path`'s weights (`load_hf`, which reads the
  config `transformer_config` reads), or a random init from `init_seed`;
  with LoRA adapters (`apply_lora`) when `lora.rank > 0`."""
  if model.hf_path:
    module = load_hf(model.hf_path, mesh=mesh, **_hf_options(model))
    cfg = module.config
  else:
    cfg, seed = transformer_config(model), model.init_seed
    module = sharding.init_sharded(
      lambda: Transformer(cfg, rngs=nnx.Rngs(seed)), mesh
    )
  if model.dtype == mixed_precision.AUTO:
    logging.info(
      "model.dtype='auto': %s compute, %s params on %s",
      cfg.dtype.name, cfg.param_dtype.name, jax.default_backend(),
    )  # fmt: skip
  if lora is not None and lora.enabled:
    apply_lora(module, lora)
    # The adapters were made on the default device: place them too.
    params = nnx.state(module)
    nnx.update(
      module, jax.device_put(params, sharding.param_shardings(params, mesh))
    )
  graphdef, params = nnx.split(module)
  return Policy(module, cfg, graphdef, sharding.param_shardings(params, mesh))
