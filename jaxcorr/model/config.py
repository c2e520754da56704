"""`TransformerConfig`: one frozen description of a Llama 3 / Qwen2 / Qwen3 model.

The three families are the same decoder (pre-norm RMSNorm, RoPE, grouped-query
attention, SwiGLU MLP) with three switches:

* Qwen2 / Qwen2.5: a bias on the q, k and v projections (`qkv_bias`);
* Qwen3: RMSNorm over the head dim of q and k before RoPE (`qk_norm`), and an
  explicit `head_dim` that need not equal `hidden_size // num_heads`;
* Llama 3.1+: RoPE frequencies rescaled for long context (`rope_scaling`).

The config is hashable (every field is a scalar, a string, a tuple or a frozen
dataclass) because NNX keeps it in the module's static graph, and `jax.jit`
hashes that graph to cache compilations.

`from_hf_config` reads a Hugging Face `config.json` (transformers 4.x keys
`rope_theta` / `rope_scaling` and 5.x key `rope_parameters` alike) and refuses
anything the model does not implement, rather than running a different model
silently; `to_hf_config` writes a dict that both transformers 4.x and 5.x load.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from jaxcorr.model.attention import ATTENTION

ARCHITECTURES = {
  'LlamaForCausalLM': 'llama',
  'Qwen2ForCausalLM': 'qwen2',
  'Qwen3ForCausalLM': 'qwen3',
  'Qwen3MoeForCausalLM': 'qwen3_moe',
  'Qwen2MoeForCausalLM': 'qwen2_moe',
  'MixtralForCausalLM': 'mixtral',
}
"""Supported Hugging Face architectures and their `model_type`."""

MOE_ARCHITECTURES = (
  'Qwen3MoeForCausalLM',
  'Qwen2MoeForCausalLM',
  'MixtralForCausalLM',
)
"""The mixture-of-experts families (`jaxcorr.model.moe`)."""

MOE_DISPATCH = ('grouped', 'dense')
"""How routed tokens reach their experts: a grouped matmul over the tokens
sorted by expert (`jax.lax.ragged_dot`), or every expert on every token (the
reference the tests compare against; E / k times the FLOPs)."""

REMAT_POLICIES = ('none', 'full', 'dots')
"""Per-layer rematerialisation: keep everything, keep nothing (recompute the
layer in the backward pass), or keep only the matmul outputs."""


class UnsupportedModelError(ValueError):
  """The checkpoint's config asks for something this model does not do."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 RoPE frequency scaling (HF `rope_type='llama3'`).

  Wavelengths shorter than `original_max_position_embeddings /
  high_freq_factor` are kept, longer than `... / low_freq_factor` are divided
  by `factor`, and the band in between is interpolated smoothly.
  """

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Shape, numerics and execution switches of the decoder.

  Params are stored in `param_dtype` and cast to `dtype` (the compute dtype)
  at use; attention softmax, RMSNorm statistics, RoPE and log-probs are always
  float32.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int | None = None  # None: hidden_size // num_heads
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10_000.0
  rope_scaling: RopeScaling | None = None
  max_position_embeddings: int = 4096
  qkv_bias: bool = False
  o_bias: bool = False  # Llama/Qwen3 `attention_bias=True` also biases o_proj
  qk_norm: bool = False
  tie_embeddings: bool = False
  param_dtype: Any = 'float32'
  dtype: Any = 'float32'
  remat: str = 'none'
  scan_layers: bool = False
  matmul_precision: str | None = None  # e.g. 'highest' for fp32 on TPU
  attention: str = 'jnp'  # one of ATTENTION (jaxcorr/model/attention.py)
  initializer_range: float = 0.02
  architecture: str = 'LlamaForCausalLM'
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  pad_token_id: int | None = None
  # The tokenizer's real vocabulary when the embedding is padded (Qwen2.5:
  # 151936 rows for 151665 tokens). Logit columns >= it are set to -inf in
  # every forward, trainer and engine alike (docs/math/rollout_contract.md §1).
  # None: every column is a real token.
  real_vocab_size: int | None = None
  # Mixture of experts (`jaxcorr.model.moe`); num_experts=0: a dense model.
  num_experts: int = 0
  num_experts_per_tok: int = 0  # k, the experts each token is routed to
  moe_intermediate_size: int = 0  # each expert's SwiGLU width
  # True: the k gates are re-normalised to sum to 1 (Qwen3-MoE, Mixtral);
  # False: they are the full-softmax probabilities (Qwen2-MoE).
  norm_topk_prob: bool = True
  shared_expert_intermediate_size: int = 0  # Qwen2-MoE; 0: none
  mlp_only_layers: tuple[int, ...] = ()  # dense layers among MoE ones
  decoder_sparse_step: int = 1  # layer i is MoE iff (i + 1) % step == 0
  moe_dispatch: str = 'grouped'  # one of MOE_DISPATCH

  def __post_init__(self):
    set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
    if self.head_dim is None:
      if self.hidden_size % self.num_heads:
        raise ValueError(
          f'hidden_size={self.hidden_size} is not a multiple of '
          f'num_heads={self.num_heads}; give head_dim explicitly'
        )
      set_('head_dim', self.hidden_size // self.num_heads)
    set_('param_dtype', jnp.dtype(self.param_dtype))
    set_('dtype', jnp.dtype(self.dtype))
    if isinstance(self.eos_token_id, list):
      set_('eos_token_id', tuple(self.eos_token_id))
    if self.real_vocab_size is not None and not (
      0 < self.real_vocab_size <= self.vocab_size
    ):
      raise ValueError(
        f'real_vocab_size={self.real_vocab_size}: expected None or an int in '
        f'(0, vocab_size={self.vocab_size}]'
      )
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f'num_heads={self.num_heads} must be a multiple of '
        f'num_kv_heads={self.num_kv_heads}'
      )
    if self.head_dim % 2:
      raise ValueError(f'head_dim={self.head_dim} must be even for RoPE')
    if self.remat not in REMAT_POLICIES:
      raise ValueError(
        f'remat={self.remat!r}: expected one of {REMAT_POLICIES}'
      )
    if self.attention not in ATTENTION:
      raise ValueError(
        f'attention={self.attention!r}: expected one of {ATTENTION}'
      )
    if self.architecture not in ARCHITECTURES:
      raise UnsupportedModelError(
        f'architecture {self.architecture!r} is not supported; supported: '
        f'{sorted(ARCHITECTURES)}'
      )
    set_('mlp_only_layers', tuple(int(i) for i in self.mlp_only_layers))
    _check_moe(self)

  # ------------------------------------------------------------- helpers

  @property
  def moe_layers(self) -> tuple[int, ...]:
    """Indices of the MoE layers (empty for a dense model), in order."""
    if not self.num_experts:
      return ()
    step = self.decoder_sparse_step
    return tuple(
      i
      for i in range(self.num_layers)
      if i not in self.mlp_only_layers and (i + 1) % step == 0
    )

  @property
  def num_groups(self) -> int:
    """Query heads per key/value head (GQA group size)."""
    return self.num_heads // self.num_kv_heads

  def replace(self, **changes: Any) -> TransformerConfig:
    """A copy with `changes` applied (e.g. `dtype='bfloat16'`)."""
    return dataclasses.replace(self, **changes)

  def num_params(self) -> int:
    """Parameter count (embeddings included, a tied head counted once)."""
    d, f, dh = self.hidden_size, self.intermediate_size, self.head_dim
    q, kv = self.num_heads * dh, self.num_kv_heads * dh
    attn = d * q + 2 * d * kv + q * d
    attn += (q + 2 * kv) * self.qkv_bias + d * self.o_bias
    attn += 2 * dh * self.qk_norm
    layer = attn + 2 * d
    moe = len(self.moe_layers)
    mlps = (self.num_layers - moe) * 3 * d * f
    if moe:
      e, fe = self.num_experts, self.moe_intermediate_size
      fs = self.shared_expert_intermediate_size
      mlps += moe * (d * e + e * 3 * d * fe + 3 * d * fs + d * bool(fs))
    head = 0 if self.tie_embeddings else self.vocab_size * d
    return self.vocab_size * d + self.num_layers * layer + mlps + d + head

  # ------------------------------------------------------------ HF config

  @classmethod
  def from_hf_config(
    cls, source: str | os.PathLike | Mapping[str, Any], **overrides: Any
  ) -> TransformerConfig:
    """From a HF `config.json` (a path, a directory holding it, or a dict).

    `overrides` set the fields HF does not carry (`param_dtype`, `dtype`,
    `remat`, `scan_layers`, `matmul_precision`). Raises
    `UnsupportedModelError` for an architecture or option this model does
    not implement, `FileNotFoundError` when there is no config file.
    """
    hf = _read_json_config(source)
    arch = _architecture(hf)
    act = hf.get('hidden_act', 'silu')
    if act not in ('silu', 'swish'):
      raise UnsupportedModelError(f'hidden_act={act!r}: only silu (SwiGLU)')
    if hf.get('mlp_bias'):
      raise UnsupportedModelError('mlp_bias=True is not supported')
    if hf.get('use_sliding_window'):
      raise UnsupportedModelError(
        'use_sliding_window=True is not supported (full attention only)'
      )
    if float(hf.get('partial_rotary_factor', 1.0)) != 1.0:
      raise UnsupportedModelError('partial_rotary_factor != 1 is unsupported')
    theta, scaling = _rope(hf)
    attention_bias = bool(hf.get('attention_bias', False))
    n_heads = hf['num_attention_heads']
    fields = dict(
      vocab_size=hf['vocab_size'],
      hidden_size=hf['hidden_size'],
      intermediate_size=hf['intermediate_size'],
      num_layers=hf['num_hidden_layers'],
      num_heads=n_heads,
      num_kv_heads=hf.get('num_key_value_heads') or n_heads,
      head_dim=hf.get('head_dim') or hf['hidden_size'] // n_heads,
      rms_norm_eps=hf.get('rms_norm_eps', 1e-6),
      rope_theta=theta,
      rope_scaling=scaling,
      max_position_embeddings=hf.get('max_position_embeddings', 4096),
      # Qwen2 always biases q/k/v (and never o); the others follow the flag.
      qkv_bias=arch in _QKV_BIASED or attention_bias,
      o_bias=arch not in _QKV_BIASED and attention_bias,
      qk_norm=arch in _QK_NORMED,
      tie_embeddings=bool(hf.get('tie_word_embeddings', False)),
      initializer_range=hf.get('initializer_range', 0.02),
      architecture=arch,
      bos_token_id=hf.get('bos_token_id'),
      eos_token_id=hf.get('eos_token_id'),
      pad_token_id=hf.get('pad_token_id'),
    )
    fields.update(_moe_fields(hf, arch))
    fields.update(overrides)
    return cls(**fields)

  def to_hf_config(self, torch_dtype: Any = None) -> dict[str, Any]:
    """The HF `config.json` dict of this model (for `save_hf`).

    Writes the RoPE settings in both the 4.x (`rope_theta`, `rope_scaling`)
    and 5.x (`rope_parameters`) spelling so either version reads it.
    """
    dtype = jnp.dtype(torch_dtype or self.param_dtype).name
    rope: dict[str, Any] = {
      'rope_type': 'default',
      'rope_theta': self.rope_theta,
    }
    scaling = None
    if self.rope_scaling is not None:
      scaling = {'rope_type': 'llama3', **dataclasses.asdict(self.rope_scaling)}
      rope.update(scaling)
    eos = self.eos_token_id
    hf = dict(
      architectures=[self.architecture],
      model_type=ARCHITECTURES[self.architecture],
      vocab_size=self.vocab_size,
      hidden_size=self.hidden_size,
      intermediate_size=self.intermediate_size,
      num_hidden_layers=self.num_layers,
      num_attention_heads=self.num_heads,
      num_key_value_heads=self.num_kv_heads,
      head_dim=self.head_dim,
      hidden_act='silu',
      rms_norm_eps=self.rms_norm_eps,
      rope_theta=self.rope_theta,
      rope_scaling=scaling,
      rope_parameters=rope,
      max_position_embeddings=self.max_position_embeddings,
      tie_word_embeddings=self.tie_embeddings,
      initializer_range=self.initializer_range,
      bos_token_id=self.bos_token_id,
      eos_token_id=list(eos) if isinstance(eos, tuple) else eos,
      pad_token_id=self.pad_token_id,
      torch_dtype=dtype,
      dtype=dtype,
      use_cache=True,
    )
    if self.architecture in _QKV_BIASED:
      if self.o_bias or not self.qkv_bias:
        raise UnsupportedModelError(
          f'{self.architecture} has q/k/v biases and no o bias'
        )
      hf.update(use_sliding_window=False, sliding_window=None)
      if self.architecture == 'Qwen2MoeForCausalLM':
        hf['qkv_bias'] = True
    else:
      if self.qkv_bias != self.o_bias:
        raise UnsupportedModelError(
          f'{self.architecture} biases q, k, v and o together or not at all'
        )
      hf['attention_bias'] = self.qkv_bias
    if self.architecture in _QK_NORMED:
      hf.update(use_sliding_window=False, sliding_window=None)
    if self.qk_norm != (self.architecture in _QK_NORMED):
      raise UnsupportedModelError('q/k RMSNorm exists only in Qwen3(-MoE)')
    if self.architecture == 'LlamaForCausalLM':
      hf['mlp_bias'] = False
    if self.architecture in MOE_ARCHITECTURES:
      hf.update(_moe_hf_config(self))
    return hf


_QKV_BIASED = ('Qwen2ForCausalLM', 'Qwen2MoeForCausalLM')
_QK_NORMED = ('Qwen3ForCausalLM', 'Qwen3MoeForCausalLM')


def _check_moe(self: TransformerConfig) -> None:
  """The MoE fields' rules (none for a dense architecture)."""
  is_moe = self.architecture in MOE_ARCHITECTURES
  if not is_moe:
    if self.num_experts:
      raise ValueError(
        f'num_experts={self.num_experts} needs an MoE architecture, one '
        f'of {MOE_ARCHITECTURES}'
      )
    return
  # Messages start `field=value` so a config section can prefix its path
  # (`jaxcorr.train.policy.ModelConfig`).
  e, k = self.num_experts, self.num_experts_per_tok
  if e < 1:
    raise ValueError(
      f'num_experts={e} is invalid for {self.architecture}; allowed: an int '
      '>= 1 (an MoE architecture)'
    )
  if not 0 < k <= e:
    raise ValueError(
      f'num_experts_per_tok={k} is invalid for {self.architecture} with '
      f'num_experts={e}; allowed: 1 <= num_experts_per_tok <= {e}'
    )
  if self.moe_intermediate_size <= 0:
    raise ValueError('moe_intermediate_size must be a positive int')
  if self.decoder_sparse_step < 1:
    raise ValueError('decoder_sparse_step must be >= 1')
  if self.moe_dispatch not in MOE_DISPATCH:
    raise ValueError(
      f'moe_dispatch={self.moe_dispatch!r}: expected one of {MOE_DISPATCH}'
    )
  if self.shared_expert_intermediate_size and (
    self.architecture != 'Qwen2MoeForCausalLM'
  ):
    raise UnsupportedModelError('a shared expert exists only in Qwen2-MoE')
  if self.scan_layers and len(self.moe_layers) != self.num_layers:
    raise ValueError(
      'scan_layers=True needs every layer to be an MoE layer (a scanned '
      f'stack is uniform); MoE layers here: {self.moe_layers}'
    )


def _moe_hf_config(self: TransformerConfig) -> dict[str, Any]:
  """The MoE keys of `to_hf_config`."""
  out: dict[str, Any] = dict(
    num_experts_per_tok=self.num_experts_per_tok,
    output_router_logits=False,
  )
  if self.architecture == 'MixtralForCausalLM':
    if self.moe_layers != tuple(range(self.num_layers)):
      raise UnsupportedModelError('every Mixtral layer is an MoE layer')
    if self.moe_intermediate_size != self.intermediate_size:
      raise UnsupportedModelError(
        'Mixtral has one MLP width: intermediate_size == moe_intermediate_size'
      )
    if not self.norm_topk_prob:
      raise UnsupportedModelError('Mixtral always re-normalises the top-k')
    out.update(num_local_experts=self.num_experts, router_jitter_noise=0.0)
    return out
  out.update(
    num_experts=self.num_experts,
    moe_intermediate_size=self.moe_intermediate_size,
    norm_topk_prob=self.norm_topk_prob,
    mlp_only_layers=list(self.mlp_only_layers),
    decoder_sparse_step=self.decoder_sparse_step,
  )
  if self.architecture == 'Qwen2MoeForCausalLM':
    if not self.shared_expert_intermediate_size:
      raise UnsupportedModelError('every Qwen2-MoE block has a shared expert')
    out['shared_expert_intermediate_size'] = (
      self.shared_expert_intermediate_size
    )
  return out


def _moe_fields(hf: Mapping[str, Any], arch: str) -> dict[str, Any]:
  """The MoE fields of a HF config (empty for a dense architecture)."""
  if arch not in MOE_ARCHITECTURES:
    return {}
  if float(hf.get('router_jitter_noise') or 0.0):
    raise UnsupportedModelError('router_jitter_noise > 0 is not supported')
  experts = hf.get('num_experts') or hf.get('num_local_experts')
  fields: dict[str, Any] = dict(
    num_experts=int(experts),
    num_experts_per_tok=int(hf['num_experts_per_tok']),
  )
  if arch == 'MixtralForCausalLM':
    fields.update(
      moe_intermediate_size=hf['intermediate_size'], norm_topk_prob=True
    )
    return fields
  fields.update(
    moe_intermediate_size=int(hf['moe_intermediate_size']),
    norm_topk_prob=bool(hf.get('norm_topk_prob', False)),
    mlp_only_layers=tuple(hf.get('mlp_only_layers') or ()),
    decoder_sparse_step=int(hf.get('decoder_sparse_step') or 1),
  )
  if arch == 'Qwen2MoeForCausalLM':
    fields['shared_expert_intermediate_size'] = int(
      hf.get('shared_expert_intermediate_size') or 0
    )
  return fields


def _read_json_config(
  source: str | os.PathLike | Mapping[str, Any],
) -> dict[str, Any]:
  if isinstance(source, Mapping):
    return dict(source)
  path = os.fspath(source)
  if os.path.isdir(path):
    path = os.path.join(path, 'config.json')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'no Hugging Face config file at {path}')
  with open(path) as f:
    return json.load(f)


def _architecture(hf: Mapping[str, Any]) -> str:
  archs = hf.get('architectures') or []
  for arch in archs:
    if arch in ARCHITECTURES:
      return arch
  by_type = {v: k for k, v in ARCHITECTURES.items()}
  if not archs and hf.get('model_type') in by_type:
    return by_type[hf['model_type']]
  raise UnsupportedModelError(
    f'unsupported architecture {archs or hf.get("model_type")!r}; '
    f'supported: {sorted(ARCHITECTURES)}'
  )


def _rope(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
  """(theta, scaling) from either the 4.x or the 5.x spelling."""
  params = dict(hf.get('rope_parameters') or {})
  if hf.get('rope_scaling'):
    params = {**dict(hf['rope_scaling']), **params}
  theta = float(params.get('rope_theta', hf.get('rope_theta', 10_000.0)))
  kind = params.get('rope_type', params.get('type', 'default'))
  if kind == 'default':
    return theta, None
  if kind != 'llama3':
    raise UnsupportedModelError(
      f'rope type {kind!r} is not supported (default and llama3 are)'
    )
  return theta, RopeScaling(
    factor=float(params['factor']),
    low_freq_factor=float(params['low_freq_factor']),
    high_freq_factor=float(params['high_freq_factor']),
    original_max_position_embeddings=int(
      params['original_max_position_embeddings']
    ),
  )
