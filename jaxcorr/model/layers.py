"""The decoder's building blocks: RMSNorm, RoPE, GQA attention, SwiGLU, layer.

Shapes: B batch, S query length, T key length (S, or the KV-cache length when
decoding), D hidden size, H query heads, K key/value heads, G = H / K query
heads per KV head, Dh head dim, F MLP width.

Parameters are stored in the layout the computation wants (kernels
[in..., out...], heads split out: q kernel [D, H, Dh], o kernel [H, Dh, D]) in
`param_dtype`, and every `nnx.Param` carries `logical_axes` naming its
dimensions for `jaxcorr.sharding`. They are cast to the compute dtype at use.
Numerically sensitive steps run in float32 whatever the compute dtype: RMSNorm
statistics, RoPE rotation, attention scores and softmax (as transformers
does, so bf16 runs stay close to the reference).

`Attention` and `DecoderLayer` take an optional per-layer KV cache `(k, v)`
([B, K, T, Dh] each: heads before time, the layout the attention dots
read without a transpose), a write index (a scalar, or one per row [B]) and an
optional `attend_len`; without a cache they run the plain training /
scoring forward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcorr.model import attention as fused
from jaxcorr.model.config import RopeScaling, TransformerConfig
from jaxcorr.model.context_parallel import gathered_attention, sequence_shards
from jaxcorr.model.quantized_cache import QuantizedKV, attend_quantized
from jaxcorr.model.quantized_weights import project
from jaxcorr.sharding import constrain

LayerCache = tuple[jax.Array, jax.Array]
"""One layer's KV cache: (k, v), each [B, K, T, Dh]."""

_NEG_INF = float(
  np.finfo(np.float32).min
)  # finite: a fully masked row stays NaN-free


def matmul_precision(cfg: TransformerConfig) -> jax.lax.Precision | None:
  """The config's `matmul_precision` as a `jax.lax.Precision` (or None)."""
  p = cfg.matmul_precision
  return None if p is None else jax.lax.Precision[p.upper()]


def param(
  rngs: nnx.Rngs | None,
  shape: tuple[int, ...],
  axes: tuple[str | None, ...],
  cfg: TransformerConfig,
  init: str = 'normal',
) -> nnx.Param:
  """A Param of `shape` with logical dimension names `axes`."""
  if init == 'normal':
    value = cfg.initializer_range * jax.random.normal(
      rngs.params(), shape, cfg.param_dtype
    )
  elif init == 'ones':
    value = jnp.ones(shape, cfg.param_dtype)
  else:
    value = jnp.zeros(shape, cfg.param_dtype)
  return nnx.Param(value, logical_axes=axes)


class RMSNorm(nnx.Module):
  """x / rms(x) * scale over the last axis; statistics in float32."""

  def __init__(self, dim: int, cfg: TransformerConfig):
    self.eps = cfg.rms_norm_eps
    self.dtype = cfg.dtype
    self.scale = param(None, (dim,), ('norm',), cfg, init='ones')

  def __call__(self, x: jax.Array) -> jax.Array:
    """[..., dim] -> [..., dim] in the compute dtype."""
    x32 = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    # Cast before the scale multiply, in the order transformers uses, so the
    # bf16 rounding points are the same.
    y = (x32 * jax.lax.rsqrt(var + self.eps)).astype(self.dtype)
    return y * self.scale[...].astype(self.dtype)


class Linear(nnx.Module):
  """An einsum projection with optional bias, e.g. 'bsd,dhk->bshk'."""

  def __init__(
    self,
    equation: str,
    kernel_shape: tuple[int, ...],
    kernel_axes: tuple[str | None, ...],
    cfg: TransformerConfig,
    *,
    bias_axes: tuple[str | None, ...] | None = None,
    rngs: nnx.Rngs,
  ):
    self.equation = equation
    self.dtype = cfg.dtype
    self.precision = matmul_precision(cfg)
    self.kernel = param(rngs, kernel_shape, kernel_axes, cfg)
    bias = None
    if bias_axes is not None:
      out = equation.split('->')[1]
      k_in = equation.split('->')[0].split(',')[1]
      shape = tuple(kernel_shape[k_in.index(c)] for c in out if c in k_in)
      bias = param(rngs, shape, bias_axes, cfg, init='zeros')
    self.bias = bias

  def __call__(self, x: jax.Array) -> jax.Array:
    # The kernel may be a narrow `QuantizedWeight` (the rollout engine's).
    y = project(
      self.equation,
      x,
      self.kernel.get_value(),
      self.dtype,
      precision=self.precision,
    )
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return y


# ------------------------------------------------------------------ RoPE


def rope_frequencies(
  head_dim: int, theta: float, scaling: RopeScaling | None
) -> np.ndarray:
  """Inverse frequencies [Dh / 2], float32, computed as transformers does.

  With Llama-3 `scaling`, long wavelengths are divided by `factor` and the
  band between the two cut-offs is interpolated.
  """
  exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
  inv = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
  if scaling is None:
    return inv
  s = scaling
  low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = (np.float32(2 * np.pi) / inv).astype(np.float32)
  scaled = np.where(wavelen > low_wavelen, inv / np.float32(s.factor), inv)
  smooth = (
    s.original_max_position_embeddings / wavelen - s.low_freq_factor
  ) / (s.high_freq_factor - s.low_freq_factor)
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(
  positions: jax.Array, inv_freq: np.ndarray
) -> tuple[jax.Array, jax.Array]:
  """(cos, sin), each [B, S, Dh / 2] float32, for integer `positions` [B, S]."""
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
  """Rotate [B, S, N, Dh] by `rope` (half-split layout, as HF `rotate_half`)."""
  cos, sin = (t[:, :, None, :] for t in rope)
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


# ------------------------------------------------------------- attention


def attend(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array,
  precision: jax.lax.Precision | None = None,
  heads_first: bool = False,
) -> jax.Array:
  """Grouped-query attention. q [B, S, H, Dh], k/v [B, T, K, Dh] (or [B, K,
  T, Dh] with `heads_first`, the cache layout), mask [B or 1, S, T] (True =
  attend) -> [B, S, H, Dh].

  Plain XLA einsums: the [B, K, G·S, T] float32 scores are materialised.
  The reference and the CPU path; the fused implementations
  (`jaxcorr.model.attention`, `model.attention`) are tested against it.

  Heads first, a KV head's G query heads stacked along the query axis: each
  (row, KV head) is then one [G·S, Dh] x [Dh, T] product over contiguous
  operands. With the scores laid out [B, K, G, S, T] and q, k, v left
  token-major, XLA:CPU ran the layer's attention forward + backward 1.45x
  slower (bench model, 64 x 160 tokens: 230 ms against 160 ms).
  """
  b, s, h, dh = q.shape
  kv = k.shape[1 if heads_first else 2]
  g = h // kv
  if s == 1 and heads_first:
    return _attend_one(q.reshape(b, kv, g, dh), k, v, mask).reshape(b, 1, h, dh)
  if not heads_first:
    k, v = (x.swapaxes(1, 2) for x in (k, v))  # [B, K, T, Dh]
  q = jnp.einsum('bskgd->bkgsd', q.reshape(b, s, kv, g, dh))
  q = q.reshape(b, kv, g * s, dh)
  t = k.shape[2]
  grouped = jnp.broadcast_to(mask[:, None, None], (mask.shape[0], 1, g, s, t))
  out = _grouped_attention(q, k, v, grouped.reshape(-1, 1, g * s, t), precision)
  return jnp.einsum('bkgsd->bskgd', out.reshape(b, kv, g, s, dh)).reshape(
    b, s, h, dh
  )


def _probs(q, k, mask, precision):
  """softmax(q·kᵀ / √Dh) over the attended keys, float32 [B, K, Q, T]."""
  scores = jnp.einsum(
    'bkqd,bktd->bkqt',
    q,
    k,
    precision=precision,
    preferred_element_type=jnp.float32,
  )
  scores = jnp.where(mask, scores * (q.shape[-1] ** -0.5), _NEG_INF)
  return jax.nn.softmax(scores, axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _grouped_attention(q, k, v, mask, precision):
  """q [B, K, Q, Dh], k/v [B, K, T, Dh], mask [B or 1, 1, Q, T] ->
  [B, K, Q, Dh].

  The backward is written out (softmax's: dS = P ⊙ (dP - rowsum(dP ⊙ P)),
  zero where masked, times 1/√Dh) rather than derived: autodiff's own
  passes over the [B, K, Q, T] scores (the scale, the select, softmax's
  jvp) made a layer's attention forward + backward 1.15x slower on
  XLA:CPU (bench model: 165 ms against 144 ms). The same products.
  """
  return _grouped_attention_fwd(q, k, v, mask, precision)[0]


def _grouped_attention_fwd(q, k, v, mask, precision):
  probs = _probs(q, k, mask, precision)
  out = jnp.einsum(
    'bkqt,bktd->bkqd', probs.astype(v.dtype), v, precision=precision
  )
  return out, (q, k, v, mask, probs)


def _grouped_attention_bwd(precision, residuals, d_out):
  q, k, v, mask, probs = residuals
  dv = jnp.einsum(
    'bkqt,bkqd->bktd', probs.astype(v.dtype), d_out, precision=precision
  )
  dp = jnp.einsum('bkqd,bktd->bkqt', d_out, v, precision=precision)
  dp = dp.astype(jnp.float32)
  ds = probs * (dp - jnp.sum(dp * probs, axis=-1, keepdims=True))
  ds = jnp.where(mask, ds * (q.shape[-1] ** -0.5), 0.0)
  dq = jnp.einsum('bkqt,bktd->bkqd', ds, k, precision=precision)
  dk = jnp.einsum('bkqt,bkqd->bktd', ds, q, precision=precision)
  return (
    dq.astype(q.dtype),
    dk.astype(k.dtype),
    dv.astype(v.dtype),
    None,
  )


_grouped_attention.defvjp(_grouped_attention_fwd, _grouped_attention_bwd)


def _attend_one(
  q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array
) -> jax.Array:
  """One query per row against the cache (decode): q [B, K, G, Dh], k/v
  [B, K, T, Dh], mask [B or 1, 1, T] -> [B, K, G, Dh].

  Broadcast multiply + reduce instead of dots: with one query, each (row,
  head) is a matrix-vector product that XLA:CPU runs as a small batched
  GEMM with poor utilisation; as a fused loop over T it streams the cache
  once.
  """
  scores = jnp.sum(
    q[:, :, :, None, :].astype(jnp.float32)
    * k[:, :, None, :, :].astype(jnp.float32),
    axis=-1,
  ) * (q.shape[-1] ** -0.5)
  scores = jnp.where(mask[:, None, None, 0], scores, _NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.sum(
    probs[..., None] * v[:, :, None, :, :].astype(jnp.float32), axis=-2
  )
  return out.astype(v.dtype)


class Attention(nnx.Module):
  """Causal GQA self-attention with RoPE, optional qkv bias and q/k norm."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    d, h, kv, dh = (
      cfg.hidden_size,
      cfg.num_heads,
      cfg.num_kv_heads,
      cfg.head_dim,
    )
    qkv_bias = cfg.qkv_bias
    self.precision = matmul_precision(cfg)
    self.attention = cfg.attention
    self.q_proj = Linear(
      'bsd,dhk->bshk',
      (d, h, dh),
      ('embed', 'heads', 'head_dim'),
      cfg,
      bias_axes=('heads', 'head_dim') if qkv_bias else None,
      rngs=rngs,
    )
    kv_axes = ('embed', 'kv_heads', 'head_dim')
    kv_bias = ('kv_heads', 'head_dim') if qkv_bias else None
    self.k_proj = Linear(
      'bsd,dhk->bshk', (d, kv, dh), kv_axes, cfg, bias_axes=kv_bias, rngs=rngs
    )
    self.v_proj = Linear(
      'bsd,dhk->bshk', (d, kv, dh), kv_axes, cfg, bias_axes=kv_bias, rngs=rngs
    )
    self.o_proj = Linear(
      'bshk,hkd->bsd',
      (h, dh, d),
      ('heads', 'head_dim', 'embed'),
      cfg,
      bias_axes=('norm',) if cfg.o_bias else None,
      rngs=rngs,
    )
    self.q_norm = RMSNorm(dh, cfg) if cfg.qk_norm else None
    self.k_norm = RMSNorm(dh, cfg) if cfg.qk_norm else None

  def __call__(
    self,
    x: jax.Array,
    rope: tuple[jax.Array, jax.Array],
    mask: jax.Array,
    cache: LayerCache | None = None,
    cache_index: jax.Array | None = None,
    attend_len: int | None = None,
  ) -> tuple[jax.Array, LayerCache | None]:
    """x [B, S, D] -> ([B, S, D], updated cache or None).

    With a cache, this step's k/v are written at slots [cache_index,
    cache_index + S) (`cache_index` scalar, or [B] for rows at different
    positions) and the queries attend over the first `attend_len` cache
    slots (default all T; `mask` is then [B, S, attend_len] and hides
    empty or foreign slots).
    """
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = apply_rope(q, rope), apply_rope(k, rope)
    q = constrain(q, ('batch', 'seq', 'act_heads', None))
    k = constrain(k, ('batch', 'seq', 'act_kv_heads', None))
    v = constrain(v, ('batch', 'seq', 'act_kv_heads', None))
    if cache is None:
      out = self._uncached(q, k, v, mask)
    else:
      cache = tuple(
        write_cache(c, jnp.swapaxes(new, 1, 2), cache_index)
        for c, new in zip(cache, (k, v))
      )
      if isinstance(cache[0], QuantizedKV):  # a narrow cache: read as is
        out = attend_quantized(q, *cache, mask, attend_len, self.precision)
      else:
        k, v = (c[:, :, :attend_len].astype(q.dtype) for c in cache)
        impl = self._impl(q)
        if impl == 'jnp' or q.shape[1] == 1:  # decode: docs/architecture.md
          out = attend(q, k, v, mask, self.precision, heads_first=True)
        else:  # a prefill or chunk: the fused kernel, cache layout swapped
          k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)
          out = fused.masked_attention(impl, q, k, v, mask, self.precision)
    return self.o_proj(out), cache

  def _impl(self, q: jax.Array) -> str:
    """`cfg.attention` resolved for this backend and q's dtype."""
    return fused.resolve(self.attention, jax.default_backend(), q.dtype)

  def _uncached(self, q, k, v, mask) -> jax.Array:
    """The forward without a cache: `mask` a `CausalSegments` (the
    transformer's) or a dense [B or 1, S, S] array."""
    impl = self._impl(q)
    packed = isinstance(mask, fused.CausalSegments)
    if packed and impl != 'jnp' and sequence_shards() == 1:
      seg = mask.segment_ids
      return fused.self_attention(impl, q, k, v, seg, self.precision)
    if impl == 'jnp':
      fn = functools.partial(attend, precision=self.precision)
    else:
      fn = functools.partial(fused.masked_attention, impl)
      fn = functools.partial(fn, precision=self.precision)
    # Rows split over the mesh's `sequence` axis: K/V gathered over it,
    # each device building its own rows of a `CausalSegments` mask.
    return gathered_attention(fn, q, k, v, mask)


def write_cache(cache: jax.Array, new: jax.Array, index: jax.Array):
  """cache [B, K, T, Dh] with `new` [B, K, S, Dh] written at slots [index,
  index + S): one dynamic-update-slice for a scalar index, a per-row
  scatter for index [B]. Both update the buffer in place when it is
  donated or carried by a loop (tests/rollout/test_cache.py checks the
  compiled decode loop for cache copies). A `QuantizedKV` cache quantizes
  `new` per token as it writes."""
  if isinstance(cache, QuantizedKV):
    return cache.write(new, index)
  new = new.astype(cache.dtype)
  if jnp.ndim(index) == 0:
    return jax.lax.dynamic_update_slice(cache, new, (0, 0, index, 0))

  def row(c, x, i):
    return jax.lax.dynamic_update_slice(c, x, (0, i, 0))

  return jax.vmap(row)(cache, new, index)


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    d, f = cfg.hidden_size, cfg.intermediate_size
    self.gate_proj = Linear(
      'bsd,df->bsf', (d, f), ('embed', 'mlp'), cfg, rngs=rngs
    )
    self.up_proj = Linear(
      'bsd,df->bsf', (d, f), ('embed', 'mlp'), cfg, rngs=rngs
    )
    self.down_proj = Linear(
      'bsf,fd->bsd', (f, d), ('mlp', 'embed'), cfg, rngs=rngs
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    h = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
    h = constrain(h, ('batch', 'seq', 'act_mlp'))
    return self.down_proj(h)


class DecoderLayer(nnx.Module):
  """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x))."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.hidden_size, cfg)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.hidden_size, cfg)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(
    self,
    x: jax.Array,
    rope: tuple[jax.Array, jax.Array],
    mask: jax.Array,
    cache: LayerCache | None = None,
    cache_index: jax.Array | None = None,
    attend_len: int | None = None,
  ) -> tuple[jax.Array, LayerCache | None]:
    """x [B, S, D] -> ([B, S, D], updated cache or None)."""
    h, cache = self.attn(
      self.attn_norm(x), rope, mask, cache, cache_index, attend_len
    )
    x = x + h
    x = x + self.mlp(self.mlp_norm(x))
    return constrain(x, ('batch', 'seq', 'act_embed')), cache
