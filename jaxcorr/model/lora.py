"""LoRA adapters on the `Transformer`'s projections, built from flax's
`nnx.LoRA` (its `nnx.LoRAParam` leaves are the only trainable ones).

    LoraConfig ─ apply_lora(model) ─ each targeted `Linear` becomes a
      `LoraLinear`: y = base(x) + alpha / r · dropout(x) A B
    split_adapter(state) ─ (adapter: the LoRAParam leaves, frozen: the rest)
    merged_kernels(state, cfg) ─ W + alpha / r · A B per targeted kernel

`nnx.LoRA` is 2-D (x [.., in] @ A [in, r] @ B [r, out]); our kernels keep
their heads split out (q [D, H, Dh], o [H, Dh, D]), so `LoraLinear`
flattens the contracted input dims and unflattens the output dims around
it. The flattened order is the HF one (head-major), so A and B are PEFT's
`lora_A.weight.T` and `lora_B.weight.T` (`jaxcorr.model.peft_io`). B starts
at zero (`nnx.LoRA`'s default), so a fresh adapter leaves the model exactly
as it was. Why `nnx.LoRA` and not qwix's provider: docs/lora.md.

With `scan_layers` the adapters are stacked like the layers ([L, in, r],
logical axis `layers`), so the scan slices them with the rest. Adapter
params are small and replicated (no logical axis but `layers`), except
those of MoE experts: in an MoE layer the MLP names (gate_proj, up_proj,
down_proj) target every expert's projection (`ExpertLora`, A [E, in, r],
sharded like the experts) and the shared expert's, never the router
(docs/lora.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcorr.config.fields import (
  Invalid,
  boolean,
  integer,
  number,
  optional,
  setting,
  validate,
)
from jaxcorr.model.layers import Linear
from jaxcorr.model.lora_experts import ExpertLora
from jaxcorr.model.moe import MoEBlock
from jaxcorr.model.transformer import Transformer

ATTENTION = ('q_proj', 'k_proj', 'v_proj', 'o_proj')
MLP = ('gate_proj', 'up_proj', 'down_proj')
TARGETS = ATTENTION + MLP
"""Module names LoRA can target (PEFT's names for Llama / Qwen)."""

_PARENT = {**{n: 'attn' for n in ATTENTION}, **{n: 'mlp' for n in MLP}}


def _targets(value: Any, path: str) -> tuple[str, ...]:
  """A comma-separated string or a sequence of `TARGETS` names."""
  del path
  if isinstance(value, str):
    value = [v.strip() for v in value.split(',') if v.strip()]
  if not isinstance(value, list | tuple) or not value:
    raise Invalid(f'a non-empty comma-separated subset of {", ".join(TARGETS)}')
  bad = [v for v in value if v not in TARGETS]
  if bad:
    raise Invalid(
      f'a non-empty comma-separated subset of {", ".join(TARGETS)}',
      f'unknown module(s) {", ".join(map(repr, bad))}',
    )
  return tuple(dict.fromkeys(value))


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters (docs/lora.md); `rank=0` trains every weight."""

  rank: int = setting(
    0, integer(0), 'Adapter rank r; 0 = off (full fine-tuning).'
  )
  alpha: float = setting(
    16.0,
    number(0, lo_open=True),
    'Adapter scale numerator: the update is alpha / rank * A B.',
  )
  dropout: float = setting(
    0.0,
    number(0, 1, hi_open=True),
    'Dropout on the adapter input in the update forward only (old, ref '
    'and rollout log-probs never drop).',
  )
  target_modules: tuple[str, ...] = setting(
    ATTENTION,
    _targets,
    'Projections that get an adapter, by PEFT name: q_proj, k_proj, '
    'v_proj, o_proj, gate_proj, up_proj, down_proj (comma-separated; in '
    'MoE layers the MLP names target every expert and the shared expert).',
    cli='q_proj,k_proj,v_proj,o_proj',
  )
  engine_merged: bool = setting(
    True,
    boolean,
    'The rollout engine decodes with W + alpha/r A B merged after each '
    'sync (True) or with the adapter applied unmerged (False).',
  )
  delivery_tol: float | None = setting(
    None,
    optional(number(0), 'by the engine dtype: 1e-3 float32, 0.1 16-bit'),
    'Largest |engine - expected| log-prob on the sync probe (expected: '
    "the trainer's score of the version in the engine's precision) before "
    'a weight sync is declared undelivered (0: no check).',
  )
  seed: int = setting(0, integer(0), 'Seed of the A matrices.')

  def __post_init__(self):
    validate(self)

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def _split_equation(equation: str) -> tuple[int, int]:
  """(number of contracted kernel dims, of output kernel dims) of a
  `Linear` einsum; kernels are laid out [in..., out...]."""
  lhs, _ = equation.split('->')
  x, k = lhs.split(',')
  n_in = sum(c in x for c in k)
  return n_in, len(k) - n_in


class LoraLinear(nnx.Module):
  """A `Linear` plus alpha / r · x A B (`nnx.LoRA`, B = 0 at init).

  Args:
    base: the wrapped projection (its kernel stays frozen in training).
    cfg: rank, alpha, dropout.
    kernel_shape: the base kernel's shape without a stacked-layer axis.
    rngs: draws A.
    stacked: the number of stacked layers (`scan_layers`), or None.
  """

  def __init__(
    self,
    base: Linear,
    cfg: LoraConfig,
    kernel_shape: tuple[int, ...],
    *,
    rngs: nnx.Rngs,
    stacked: int | None = None,
  ):
    self.base = base
    n_in, _ = _split_equation(base.equation)
    self.n_in = n_in
    self.out_shape = tuple(kernel_shape[n_in:])
    self.scale = cfg.scale
    self.dropout = cfg.dropout
    self.dropout_key = None  # set by `enable_dropout` in the update only
    fin, fout = math.prod(kernel_shape[:n_in]), math.prod(self.out_shape)

    def make(rngs: nnx.Rngs) -> nnx.LoRA:
      return nnx.LoRA(
        fin,
        cfg.rank,
        fout,
        dtype=base.dtype,
        param_dtype=base.kernel[...].dtype,
        rngs=rngs,
        a_metadata={'logical_axes': (None, None)},
        b_metadata={'logical_axes': (None, None)},
      )

    if stacked is None:
      self.lora = make(rngs)
    else:  # one adapter per layer, stacked like the layers' params
      make = nnx.split_rngs(splits=stacked)(
        nnx.vmap(make, in_axes=(0,), out_axes=0)
      )
      self.lora = make(rngs)
      for _, v in nnx.iter_graph(self.lora):
        if isinstance(v, nnx.LoRAParam):
          v.set_metadata(logical_axes=('layers', None, None))

  def __call__(self, x: jax.Array) -> jax.Array:
    y = self.base(x)
    lead = x.shape[: x.ndim - self.n_in]
    h = x.reshape(*lead, -1).astype(self.base.dtype)
    if self.dropout > 0 and self.dropout_key is not None:
      keep = jax.random.bernoulli(self.dropout_key, 1 - self.dropout, h.shape)
      h = jnp.where(keep, h / (1 - self.dropout), 0).astype(h.dtype)
    delta = self.lora(h) * jnp.asarray(self.scale, h.dtype)
    return y + delta.reshape(*lead, *self.out_shape).astype(y.dtype)


def apply_lora(model: Transformer, cfg: LoraConfig) -> Transformer:
  """Wraps `cfg.target_modules` of every layer of `model` in `LoraLinear`
  (in place; returns `model`). A is drawn from `cfg.seed`, B is zero."""
  rngs = nnx.Rngs(cfg.seed)
  stacked = model.config.scan_layers
  n = model.config.num_layers if stacked else None
  layers = [model.layers] if stacked else list(model.layers)

  def wrap(parent, name):
    base = getattr(parent, name)
    shape = base.kernel.shape[1:] if stacked else base.kernel.shape
    setattr(parent, name, LoraLinear(base, cfg, shape, rngs=rngs, stacked=n))

  for layer in layers:
    for name in cfg.target_modules:
      parent = getattr(layer, _PARENT[name])
      if not isinstance(parent, MoEBlock):
        wrap(parent, name)
        continue
      expert = ExpertLora(
        getattr(parent, name),
        rank=cfg.rank,
        scale=cfg.scale,
        dropout=cfg.dropout,
        dtype=parent.dtype,
        rngs=rngs,
        stacked=n,
      )
      setattr(parent, name, expert)
      if parent.shared_expert is not None:  # Qwen2-MoE: a plain MLP
        wrap(parent.shared_expert, name)
  return model


def lora_model(
  config: Any, cfg: LoraConfig, *, rngs: nnx.Rngs | None = None
) -> Transformer:
  """A fresh `Transformer(config)` with adapters (`eval_shape`-able)."""
  return apply_lora(Transformer(config, rngs=rngs or nnx.Rngs(0)), cfg)


def has_lora(tree: Any) -> bool:
  """Whether a module or state holds any `nnx.LoRAParam`."""
  if isinstance(tree, nnx.Module):
    tree = nnx.state(tree)
  return bool(jax.tree.leaves(nnx.filter_state(tree, nnx.LoRAParam)))


def split_adapter(state: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(adapter: the `nnx.LoRAParam` leaves, frozen: everything else)."""
  adapter, frozen = nnx.split_state(state, nnx.LoRAParam, ...)
  return adapter, frozen


def join(frozen: nnx.State, adapter: nnx.State) -> nnx.State:
  """The whole model state from its two parts (no array is copied)."""
  return nnx.merge_state(frozen, adapter)


def enable_dropout(model: Transformer, key: jax.Array) -> None:
  """Gives every `LoraLinear` of `model` (a merged copy inside a traced
  update) its own dropout key; without one the adapter never drops."""
  i = 0
  for _, m in nnx.iter_graph(model):
    if isinstance(m, LoraLinear | ExpertLora) and m.dropout > 0:
      m.dropout_key = nnx.data(jax.random.fold_in(key, i))
      i += 1


# ---------------------------------------------------------------- merging


def _adapter_paths(pure: dict) -> list[tuple]:
  """Paths (tuples of keys) of every LoraLinear / ExpertLora in a
  pure-dict state: the dicts holding both `base` and `lora`."""
  out = []

  def walk(d, path):
    if isinstance(d, dict):
      if 'base' in d and 'lora' in d:
        out.append(path)
        return
      for k, v in d.items():
        walk(v, (*path, k))

  walk(pure, ())
  return out


def _get(d: dict, path: tuple) -> Any:
  for k in path:
    d = d[k]
  return d


def delta(a: jax.Array, b: jax.Array, scale: float, shape: tuple) -> jax.Array:
  """alpha / r · A B reshaped to the kernel `shape` (a [.., in, r], b
  [.., r, out]; leading stacked-layer and expert axes kept), float32
  accumulation."""
  d = jnp.einsum(
    '...ir,...ro->...io',
    a.astype(jnp.float32),
    b.astype(jnp.float32),
    precision=jax.lax.Precision.HIGHEST,
  )
  return (scale * d).reshape(shape)


def merged_pure(pure: dict, scale: float) -> dict:
  """A LoRA model's pure-dict state -> the plain `Transformer`'s, with
  W + scale · A B in each targeted kernel (dtype of W; per expert,
  W_e + scale · A_e B_e, for stacked experts)."""

  def copy(d):
    return {k: copy(v) for k, v in d.items()} if isinstance(d, dict) else d

  out = copy(pure)
  for path in _adapter_paths(pure):
    node = _get(pure, path)
    linear = isinstance(node['base'], dict)  # LoraLinear; else ExpertLora
    w = node['base']['kernel'] if linear else node['base']
    d = delta(node['lora']['lora_a'], node['lora']['lora_b'], scale, w.shape)
    w = (w.astype(jnp.float32) + d).astype(w.dtype)
    parent = _get(out, path[:-1])
    parent[path[-1]] = {**node['base'], 'kernel': w} if linear else w
  return out


def plain_pure(pure: dict) -> dict:
  """A LoRA model's pure-dict state without its adapters (the base)."""

  def strip(d):
    if not isinstance(d, dict):
      return d
    if 'base' in d and 'lora' in d:
      return strip(d['base'])
    return {k: strip(v) for k, v in d.items()}

  return strip(pure)


def merge_into(
  abstract_plain: nnx.State, state: nnx.State, scale: float
) -> nnx.State:
  """The plain `Transformer` state (`abstract_plain`'s structure and
  metadata) of the LoRA model state `state`, adapters merged."""
  merged = merged_pure(nnx.to_pure_dict(state), scale)
  out = jax.tree.map(lambda x: x, abstract_plain)
  nnx.replace_by_pure_dict(out, merged)
  return out


# ------------------------------------------------------ the delivery probe


PROBE_LENGTH = 16
"""Tokens of the delivery probe row."""


def probe_tokens(vocab_size: int, length: int = PROBE_LENGTH) -> jax.Array:
  """The fixed [1, length] token row both sides of a weight sync score."""
  return (jnp.arange(length, dtype=jnp.int32)[None] * 7919 + 3) % vocab_size


def probe_logprobs(graphdef: Any, params: Any, tokens: jax.Array) -> jax.Array:
  """log p(token t+1 | ..t) on `tokens` [1, S] -> [S - 1] float32 (plain
  forward: works on a LoRA or a merged model's state)."""
  model = nnx.merge(graphdef, params)
  logits = model(tokens)[0, :-1].astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1)[:, 0]
