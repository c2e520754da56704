"""LoRA adapters on an `MoEBlock`'s stacked experts: one `nnx.LoRA` per
expert, stacked like the experts.

    W [E, in, out] ─ ExpertLora ─ h W_e + alpha / r · dropout(h) A_e B_e
      A [E, in, r], B [E, r, out]  (`nnx.LoRAParam`, B = 0 at init)

The adapter replaces the stacked kernel attribute of the block
(`mlp.gate_proj` etc.) and keeps it as `base`, the layout `LoraLinear`
uses, so the generic helpers of jaxcorr/model/lora.py (`plain_pure`,
`merged_pure`, `split_adapter`) treat both alike. `MoEBlock` asks it for
the low-rank term of whichever dispatch it runs (the `ExpertAdapter`
contract of jaxcorr/model/moe.py): `grouped` runs x A then B as two more
`jax.lax.ragged_dot`s over the same expert-sorted rows and group sizes as
the base kernel, `dense` runs every expert's adapter on every token (the
reference). A and B carry the logical axis `expert`, so they shard like
the experts (jaxcorr/sharding.py); with `scan_layers` they are stacked
once more ([L, E, in, r], axis `layers`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

EXPERT_AXES = ('expert', None, None)
"""Logical axes of one layer's A [E, in, r] and B [E, r, out]."""


class ExpertLora(nnx.Module):
  """Stacked expert kernel (frozen in training) plus per-expert adapters.

  Args:
    base: the block's stacked kernel `nnx.Param` [E, in, out] (or [L, E,
      in, out] when `stacked`).
    rank, scale, dropout: r, alpha / r, dropout rate on the adapter input.
    dtype: the block's compute dtype.
    rngs: draws A (one key per expert, per layer when stacked).
    stacked: the number of stacked layers (`scan_layers`), or None.
  """

  def __init__(
    self,
    base: nnx.Param,
    *,
    rank: int,
    scale: float,
    dropout: float,
    dtype: Any,
    rngs: nnx.Rngs,
    stacked: int | None = None,
  ):
    self.base = base
    self.scale = scale
    self.dropout = dropout
    self.dtype = dtype
    self.dropout_key = None  # set by `enable_dropout` in the update only
    shape = base.shape[1:] if stacked else base.shape
    e, fin, fout = shape

    def one(rngs: nnx.Rngs) -> nnx.LoRA:
      return nnx.LoRA(
        fin,
        rank,
        fout,
        dtype=dtype,
        param_dtype=base[...].dtype,
        rngs=rngs,
      )

    make = nnx.split_rngs(splits=e)(nnx.vmap(one, in_axes=(0,), out_axes=0))
    axes = EXPERT_AXES
    if stacked is not None:
      make = nnx.split_rngs(splits=stacked)(
        nnx.vmap(make, in_axes=(0,), out_axes=0)
      )
      axes = ('layers', *axes)
    self.lora = make(rngs)
    for _, v in nnx.iter_graph(self.lora):
      if isinstance(v, nnx.LoRAParam):
        v.set_metadata(logical_axes=axes)

  def kernel(self) -> jax.Array:
    """The base kernel [E, in, out] in compute dtype."""
    return self.base[...].astype(self.dtype)

  def _factors(self, h: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dropped-out input, A, B) in compute dtype."""
    h = h.astype(self.dtype)
    if self.dropout > 0 and self.dropout_key is not None:
      keep = jax.random.bernoulli(self.dropout_key, 1 - self.dropout, h.shape)
      h = jnp.where(keep, h / (1 - self.dropout), 0).astype(h.dtype)
    a = self.lora.lora_a[...].astype(self.dtype)
    b = self.lora.lora_b[...].astype(self.dtype)
    return h, a, b

  def grouped(
    self,
    h: jax.Array,
    sizes: jax.Array,
    precision: jax.lax.Precision | None = None,
  ) -> jax.Array:
    """alpha / r · h A_e B_e for rows `h` [M, in] sorted by expert, group
    sizes [E] -> [M, out]."""
    h, a, b = self._factors(h)
    low = jax.lax.ragged_dot(h, a, sizes, precision=precision)
    out = jax.lax.ragged_dot(low, b, sizes, precision=precision)
    return out * jnp.asarray(self.scale, out.dtype)

  def dense(
    self, h: jax.Array, precision: jax.lax.Precision | None = None
  ) -> jax.Array:
    """alpha / r · h A_e B_e for every expert: h [N, in] (the tokens) or
    [E, N, in] (each expert's own input) -> [E, N, out]."""
    h, a, b = self._factors(h)
    spec = 'nd,edr->enr' if h.ndim == 2 else 'end,edr->enr'
    low = jnp.einsum(spec, h, a, precision=precision)
    out = jnp.einsum('enr,erf->enf', low, b, precision=precision)
    return out * jnp.asarray(self.scale, out.dtype)
