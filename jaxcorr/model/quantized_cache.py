"""A narrow (int8 / fp8) KV cache: one layer's keys or values stored in the
narrow type with one float32 scale per token and KV head
(`rollout.kv_cache_dtype`, docs/precision.md).

Per token and head (absmax over the head dimension): a token's scale is
fixed when it is written, so writing never rescales older entries, and in
attention the scale factors out of the head-dim sums:

    q · k_t      = s_k[t] · (q · k̂_t)
    Σ_t p_t v_t  = Σ_t (p_t s_v[t]) v̂_t

so decode attention reads the narrow values directly (converted inside the
fused reductions) and never builds a full-precision copy of the cache.
qwix's `QArray` could hold these arrays, but its einsum has no per-row
dynamic write or the folded-scale attention above, and the cache is
donated and written in place every step: a small struct of two arrays is
what the decode loop needs.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

KV_QTYPES = {'int8': jnp.int8, 'fp8': jnp.float8_e4m3fn}
"""`rollout.kv_cache_dtype` narrow names -> storage dtype."""

_NEG_INF = float(np.finfo(np.float32).min)


def _bound(dtype: Any) -> float:
  if jnp.issubdtype(dtype, jnp.integer):
    return float(jnp.iinfo(dtype).max)
  return float(jnp.finfo(dtype).max)


def quantize_kv(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
  """x [..., Dh] -> (values [..., Dh] in `dtype`, scale [...] float32),
  symmetric absmax per vector."""
  x32 = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x32), axis=-1)
  scale = jnp.where(amax > 0, amax / _bound(dtype), 1.0)
  y = x32 / scale[..., None]
  if jnp.issubdtype(dtype, jnp.integer):
    y = jnp.clip(jnp.round(y), -_bound(dtype), _bound(dtype))
  return y.astype(dtype), scale


@flax.struct.dataclass
class QuantizedKV:
  """One layer's keys (or values): values [B, K, T, Dh] narrow, scale
  [B, K, T] float32."""

  values: jax.Array
  scale: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    return self.values.shape

  @property
  def dtype(self) -> Any:
    return self.values.dtype

  @classmethod
  def zeros(cls, shape: tuple[int, ...], dtype: Any) -> QuantizedKV:
    return cls(jnp.zeros(shape, dtype), jnp.ones(shape[:-1], jnp.float32))

  def dequantize(self, dtype: Any) -> jax.Array:
    """The full-precision cache (tests and references only)."""
    v = self.values.astype(jnp.float32) * self.scale[..., None]
    return v.astype(dtype)

  def write(self, new: jax.Array, index: jax.Array) -> QuantizedKV:
    """`new` [B, K, S, Dh] quantized into slots [index, index + S) (index
    a scalar or [B]); in place when the cache is donated."""
    vals, scale = quantize_kv(new, self.values.dtype)
    if jnp.ndim(index) == 0:
      return QuantizedKV(
        jax.lax.dynamic_update_slice(self.values, vals, (0, 0, index, 0)),
        jax.lax.dynamic_update_slice(self.scale, scale, (0, 0, index)),
      )

    def row(c, s, x, xs, i):
      return (
        jax.lax.dynamic_update_slice(c, x, (0, i, 0)),
        jax.lax.dynamic_update_slice(s, xs, (0, i)),
      )

    return QuantizedKV(
      *jax.vmap(row)(self.values, self.scale, vals, scale, index)
    )

  def put_rows(self, rows: jax.Array, slots: jax.Array) -> QuantizedKV:
    """Full-precision rows [M, K, P, Dh] quantized into slots [M] at
    positions [0, P) (slot >= B: dropped)."""
    vals, scale = quantize_kv(rows, self.values.dtype)
    p = rows.shape[2]
    return QuantizedKV(
      self.values.at[slots, :, :p].set(vals, mode='drop'),
      self.scale.at[slots, :, :p].set(scale, mode='drop'),
    )

  def blend_prefix(self, new: jax.Array, keep: jax.Array) -> QuantizedKV:
    """Positions [0, L) of rows where `keep` [B] replaced by `new` [B, K,
    L, Dh] (quantized); other rows unchanged."""
    vals, scale = quantize_kv(new, self.values.dtype)
    n = new.shape[2]
    k4, k3 = keep[:, None, None, None], keep[:, None, None]
    return QuantizedKV(
      self.values.at[:, :, :n].set(jnp.where(k4, vals, self.values[:, :, :n])),
      self.scale.at[:, :, :n].set(jnp.where(k3, scale, self.scale[:, :, :n])),
    )


def attend_quantized(
  q: jax.Array,
  k: QuantizedKV,
  v: QuantizedKV,
  mask: jax.Array,
  attend_len: int | None,
  precision: Any = None,
) -> jax.Array:
  """Grouped-query attention over a narrow cache: q [B, S, H, Dh], mask
  [B or 1, S, T'] with T' = attend_len or T -> [B, S, H, Dh] in q's dtype.

  The per-token scales multiply the scores and the probabilities (module
  docstring); one query (decode) is a broadcast multiply + reduce like
  `jaxcorr.model.layers.attend`'s, so the narrow values are converted
  inside the fused loop over T."""
  b, s, h, dh = q.shape
  t = attend_len or k.shape[2]
  kv = k.shape[1]
  kq, ks = k.values[:, :, :t], k.scale[:, :, :t]
  vq, vs = v.values[:, :, :t], v.scale[:, :, :t]
  q = q.reshape(b, s, kv, h // kv, dh)
  if s == 1:
    q1 = q[:, 0].astype(jnp.float32)  # [B, K, G, Dh]
    raw = jnp.sum(
      q1[:, :, :, None, :] * kq[:, :, None, :, :].astype(jnp.float32), -1
    )[:, :, :, None]  # [B, K, G, 1, T]
  else:
    raw = jnp.einsum(
      'bskgd,bktd->bkgst',
      q,
      kq.astype(q.dtype),
      precision=precision,
      preferred_element_type=jnp.float32,
    )
  scores = raw * ks[:, :, None, None, :] * (dh**-0.5)
  scores = jnp.where(mask[:, None, None], scores, _NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1) * vs[:, :, None, None, :]
  if s == 1:
    out = jnp.sum(
      probs[:, :, :, 0, :, None] * vq[:, :, None].astype(jnp.float32), -2
    )[:, None]  # [B, 1, K, G, Dh]
  else:
    out = jnp.einsum(
      'bkgst,bktd->bskgd',
      probs.astype(q.dtype),
      vq.astype(q.dtype),
      precision=precision,
    )
  return out.reshape(b, s, h, dh).astype(q.dtype)
