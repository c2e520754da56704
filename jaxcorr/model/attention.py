"""Fused attention behind `TransformerConfig.attention` (`model.attention`).

    'jnp'     the reference: `jaxcorr.model.layers.attend`, einsums with the
              [B, K, G·S, T] float32 scores materialised and the backward
              written out; the CPU path and what the others are tested
              against (tests/model/test_attention.py)
    'xla'     `jax.nn.dot_product_attention(implementation='xla')`
    'cudnn'   the same call with implementation='cudnn': cuDNN flash
              attention (GPU, bf16/fp16 only: it has no float32 kernel)
    'splash'  the Pallas TPU splash kernel (`splash_attention`): the causal
              mask static, packing as the kernel's segment ids, masked
              blocks skipped
    'splash_interpret'  the same kernel run by the Pallas interpreter, on
              any backend (tests, debugging; slow)
    'auto'    by backend when the model runs: 'jnp' on CPU, 'splash' on
              TPU, 'cudnn' on GPU for bf16/fp16 inputs ('xla' for float32)

Two entry points with the layout of `layers.attend` (q [B, S, H, Dh], k/v
[B, T, K, Dh], K dividing H: GQA), so a context-parallel wrapper can take
either as is:

    self_attention    causal within segments (training / scoring forward):
                      query i sees key j iff j <= i and seg[i] == seg[j];
    masked_attention  any [B or 1, S, T] boolean mask (a prefill or chunk
                      over the KV cache, left-padded prompts in slots).

Splash takes no arbitrary mask: its mask is static per shape, so
`masked_attention` with 'splash' runs 'xla' (the cache's masks depend on
the traced write index). Scores and softmax are float32 in every
implementation, as in the reference.
"""

from __future__ import annotations

import contextlib

import flax.struct
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import (
  splash_attention_kernel as splash,
)
from jax.experimental.pallas.ops.tpu.splash_attention import (
  splash_attention_mask as splash_mask,
)
from jax.sharding import PartitionSpec as P

from jaxcorr.sharding import logical_to_spec

ATTENTION = ('jnp', 'xla', 'cudnn', 'splash', 'splash_interpret', 'auto')
"""The values of `model.attention` (module doc)."""

_BACKENDS = {
  'xla': ('cpu', 'gpu', 'tpu'),
  'cudnn': ('gpu',),
  'splash': ('tpu',),
}
"""Where each implementation runs ('jnp', 'splash_interpret': anywhere)."""

_NARROW = ('bfloat16', 'float16')

SPLASH_BLOCK = 128
"""Splash pads the sequence to a multiple of this (the TPU lane width) and
tiles it in the largest of 512 / 256 / 128 that divides the padded length."""


def resolve(name: str, backend: str, dtype) -> str:
  """The implementation `name` runs as on `backend` for inputs of `dtype`
  ('auto' chosen; every other name as is)."""
  if name != 'auto':
    return name
  if backend == 'tpu':
    return 'splash'
  if backend in ('gpu', 'cuda', 'rocm'):
    return 'cudnn' if jnp.dtype(dtype).name in _NARROW else 'xla'
  return 'jnp'


def refusal(name: str, backend: str, dtypes: tuple) -> str | None:
  """Why `backend` cannot run attention `name` for compute `dtypes` (the
  trainer's and the engine's), or None. A one-line reason for a config
  error naming `model.attention`."""
  backend = 'gpu' if backend in ('cuda', 'rocm') else backend
  for dtype in dtypes:
    impl = resolve(name, backend, dtype)
    where = _BACKENDS.get(impl)
    if where is not None and backend not in where:
      return f"'{impl}' runs on {'/'.join(where)} only, this is {backend}"
    if impl == 'cudnn' and jnp.dtype(dtype).name not in _NARROW:
      return f'cuDNN flash attention has no {jnp.dtype(dtype).name} kernel'
  return None


def allowed(backend: str) -> str:
  """The values `backend` runs, for the error message."""
  backend = 'gpu' if backend in ('cuda', 'rocm') else backend
  ok = [n for n in ATTENTION if backend in _BACKENDS.get(n, (backend,))]
  return ', '.join(repr(n) for n in ok)


def _precision(precision):
  """XLA's dots inside `dot_product_attention` at the model's precision
  (it takes none itself)."""
  if precision is None:
    return contextlib.nullcontext()
  return jax.default_matmul_precision(str(precision.name).lower())


def self_attention(
  impl: str,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  segment_ids: jax.Array | None,
  precision: jax.lax.Precision | None = None,
) -> jax.Array:
  """Causal attention within segments: q [B, S, H, Dh], k/v [B, S, K, Dh],
  segment_ids [B, S] (any ints) or None (one sequence) -> [B, S, H, Dh].

  `impl` is a resolved fused implementation ('xla', 'cudnn', 'splash',
  'splash_interpret'). Segments need no positions: causal within equal ids
  is exactly the packed rows' mask, and each query sees at least itself.
  """
  if impl.startswith('splash'):
    interpret = impl == 'splash_interpret'
    return _per_batch_shard(_splash, q, k, v, segment_ids, interpret)
  mask = None
  if segment_ids is not None:
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
  with _precision(precision):
    return jax.nn.dot_product_attention(
      q, k, v, mask=mask, is_causal=True, implementation=impl
    )


def masked_attention(
  impl: str,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array,
  precision: jax.lax.Precision | None = None,
) -> jax.Array:
  """q [B, S, H, Dh], k/v [B, T, K, Dh], mask [B or 1, S, T] (True =
  attend) -> [B, S, H, Dh]. Splash runs 'xla' here (module doc).

  A query that sees no key (a left-padding slot of the cache: segment 0)
  attends to every key instead, so its output stays finite (its value is
  never read; the reference gives it uniform weights).
  """
  impl = 'xla' if impl.startswith('splash') else impl
  mask = mask | ~jnp.any(mask, axis=-1, keepdims=True)
  with _precision(precision):
    return jax.nn.dot_product_attention(
      q,
      k.astype(q.dtype),
      v.astype(q.dtype),
      mask=mask[:, None],
      implementation=impl,
    )


def _per_batch_shard(fn, q, k, v, segment_ids, *static):
  """`fn(q, k, v, segment_ids, *static)` on each device's rows when the
  mesh set by `jax.set_mesh` splits the batch: a Pallas kernel is a custom
  call the SPMD partitioner cannot split (it would gather the operands),
  so it runs under a `shard_map` manual over the batch's mesh axes (the
  others, e.g. a tensor axis on heads, stay automatic: XLA gathers them)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn(q, k, v, segment_ids, *static)
  spec = logical_to_spec(('batch',), shape=q.shape[:1], mesh=mesh)
  if spec[0] is None:
    return fn(q, k, v, segment_ids, *static)
  axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
  rows = P(spec[0])
  ids = () if segment_ids is None else (segment_ids,)

  def local(q, k, v, *ids):
    return fn(q, k, v, ids[0] if ids else None, *static)

  return jax.shard_map(
    local,
    in_specs=(rows,) * (3 + len(ids)),
    out_specs=rows,
    axis_names=set(axes),
    check_vma=False,  # the kernel's outputs carry no varying-axes types
  )(q, k, v, *ids)


def _splash(q, k, v, segment_ids, interpret):
  """The splash kernel over rows (vmap) with GQA in the kernel: q is scaled
  by 1/√Dh first (the kernel does not scale), the sequence padded to a
  multiple of SPLASH_BLOCK with padding in its own segment (no real query
  sees it), the output cut back."""
  b, s, h, dh = q.shape
  pad = -s % SPLASH_BLOCK
  if segment_ids is None and pad:
    segment_ids = jnp.zeros((b, s), jnp.int32)
  if segment_ids is not None:
    seg = segment_ids.astype(jnp.int32)
    if pad:  # padding: an id above every real one
      fill = jnp.broadcast_to(jnp.max(seg) + 1, (b, pad))
      seg = jnp.concatenate([seg, fill], axis=1)
  scale = jnp.asarray(dh**-0.5, jnp.float32)
  q = (q.astype(jnp.float32) * scale).astype(q.dtype)
  qkv = (
    jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).swapaxes(1, 2)
    for x in (q, k, v)
  )  # [B, heads, S + pad, Dh]: the kernel's layout
  kernel = _splash_kernel(h, s + pad, interpret)
  if segment_ids is None:
    out = jax.vmap(kernel)(*qkv)
  else:
    ids = splash.SegmentIds(q=seg, kv=seg)
    out = jax.vmap(lambda q, k, v, i: kernel(q, k, v, segment_ids=i))(*qkv, ids)
  return out.swapaxes(1, 2)[:, :s].astype(v.dtype)


def _splash_kernel(heads: int, length: int, interpret: bool):
  """A causal splash kernel for `heads` query heads over `length` tokens,
  built where it is traced: its mask arrays belong to that trace (and its
  mesh); the mask's block structure is processed on the host."""
  block = next(n for n in (512, 256, 128) if length % n == 0)
  causal = splash_mask.CausalMask((length, length))
  mask = splash_mask.MultiHeadMask([causal] * heads)
  sizes = splash.BlockSizes(
    block_q=block,
    block_kv=block,
    block_q_dkv=block,
    block_kv_dkv=block,
    block_q_dq=block,
    block_kv_dq=block,
  )
  return splash.make_splash_mha(
    mask, head_shards=1, q_seq_shards=1, block_sizes=sizes, interpret=interpret
  )


@flax.struct.dataclass
class CausalSegments:
  """The training / scoring forward's mask as the fused kernels take it:
  causal within `segment_ids` [B, S] (None: one sequence per row). The
  dense form is built where the 'jnp' reference needs it."""

  segment_ids: jax.Array | None
  length: int = flax.struct.field(pytree_node=False)

  def dense(self) -> jax.Array:
    """[B or 1, S, S] bool, True = attend."""
    causal = jnp.tril(jnp.ones((self.length, self.length), bool))[None]
    seg = self.segment_ids
    if seg is None:
      return causal
    return causal & (seg[:, :, None] == seg[:, None, :])
