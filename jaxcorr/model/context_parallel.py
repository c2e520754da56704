"""Context parallelism: training rows split along the `sequence` mesh axis.

With `mesh.sequence = n > 1` every activation between layers is [B, S, D]
with S split n ways (logical axis `seq`, jaxcorr/sharding.py): each device
holds S/n consecutive positions of its rows, so the per-layer activations,
the saved residuals of the backward pass and the log-prob head's chunks all
shrink n-fold. Everything position-wise (projections, RoPE, norms, MLP, the
MoE experts) needs no communication; only attention mixes positions.

Attention here gathers keys and values (`gathered_attention`): inside a
`shard_map` manual over `sequence` only (batch, heads stay under the SPMD
partitioner), each device all-gathers the row's K and V [B, S, K, Dh] and
attends its S/n queries to all S keys. The causal-within-segments mask of
the training forward is built per device, [B, S/n, S] (its query
positions against every key position and segment id), so packing needs
nothing more and no device holds the [B, S, S] mask. The backward's
transpose of the all-gather is a reduce-scatter of dK, dV (in float32:
`_gather_rows`).

Why this and not ring attention or all-to-all (DeepSpeed-Ulysses):

* per layer it moves (n - 1)/n of K and V once forward and once backward,
  the same bytes a ring rotates, in one collective XLA can overlap with the
  q projection; with GQA (Llama-3-8B: 8 KV heads of 32) K and V are each
  a quarter of q, so gathering them costs less than the all-to-all of q,
  k, v and the output that Ulysses needs;
* Ulysses splits heads: the axis must divide the KV heads (8 for
  Llama-3-8B, 4 for Qwen3-30B-A3B) and cannot be combined with a tensor
  axis that already splits them; the gather has no such limit;
* the cost: each device holds the row's whole K and V for the layer being
  computed (Llama-3-8B at 32k tokens: 2 x 32k x 8 x 128 x 2 bytes = 128 MiB
  in bf16, kept per layer for the backward unless the layer is
  rematerialised), where a ring holds two blocks; and
  with the reference attention (`layers.attend`) the scores are [S/n, S]
  per head instead of a ring's [S/n, S/n] blocks. The fused attention
  kernels keep scores in on-chip memory, so only the K/V copy remains.
  Causal load is unbalanced (the last shard attends to n times the first
  shard's keys); a ring with zig-zag order balances it, at the price of n
  dependent steps per layer.

`gathered_attention` wraps any attention `attend(q, k, v, dense_mask)`
with the layout of `layers.attend`, so a fused kernel taking a mask
(`attention.masked_attention`) is wrapped the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

AXIS = 'sequence'


def sequence_shards() -> int:
  """Size of the `sequence` axis of the mesh set by `jax.set_mesh` (1
  outside a mesh or without the axis)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  return dict(mesh.shape).get(AXIS, 1)


def gathered_attention(
  attend: Callable[..., jax.Array],
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: Any,
) -> jax.Array:
  """`attend(q, k, v, dense_mask)` with q, k, v [B, S, N, Dh] and the
  output split over the `sequence` axis, K and V gathered over it (module
  doc).

  `mask`: a [B or 1, S, S] bool array (True = attend), whose rows each
  device reads for its own queries, or the forward's causal-within-segments
  mask (`segment_ids` [B, S] or None, `dense()`), from which each device
  builds only its [B, S/n, S] block. `attend` takes a dense mask [B or 1,
  S_q, T] (`layers.attend` does). Unsplit when the mesh has no sequence
  axis or S does not divide by it.
  """
  n = sequence_shards()
  dense = isinstance(mask, jax.Array)
  if n == 1 or q.shape[1] % n:
    return attend(q, k, v, mask if dense else mask.dense())
  rows = P(None, AXIS)
  if dense:
    args, specs = (mask,), (P(None, AXIS, None),)
  elif mask.segment_ids is None:
    args, specs = (), ()
  else:  # every device reads the whole row's ids (keys') and its own
    args, specs = (mask.segment_ids,), (P(),)

  def local(q, k, v, *m):
    k, v = _gather_rows(k), _gather_rows(v)
    block = m[0] if dense else _causal_block(q.shape[1], k.shape[1], *m)
    return attend(q, k, v, block)

  return jax.shard_map(
    local,
    in_specs=(rows, rows, rows, *specs),
    out_specs=rows,
    axis_names={AXIS},
  )(q, k, v, *args)


@jax.custom_vjp
def _gather_rows(x: jax.Array) -> jax.Array:
  """[B, S/n, ...] -> [B, S, ...]: the row's positions of every device.

  The backward (a reduce-scatter: the sum of the n devices' partial dK,
  dV) adds in float32, whatever x's dtype: n bf16 partial sums would round
  at every add, and XLA:CPU cannot compile a bf16 reduce-scatter (its
  check fails: "Invalid binary instruction opcode copy")."""
  return jax.lax.all_gather(x, AXIS, axis=1, tiled=True)


def _gather_rows_fwd(x):
  return _gather_rows(x), None


def _gather_rows_bwd(_, grad):
  summed = jax.lax.psum_scatter(
    grad.astype(jnp.float32), AXIS, scatter_dimension=1, tiled=True
  )
  return (summed.astype(grad.dtype),)


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def _causal_block(
  length: int, total: int, segment_ids: jax.Array | None = None
) -> jax.Array:
  """This device's rows of the causal (within `segment_ids` [B, total])
  mask: queries at positions [i·length, (i + 1)·length) of shard i against
  all `total` keys, [B or 1, length, total] bool."""
  start = jax.lax.axis_index(AXIS) * length
  q_pos = start + jnp.arange(length, dtype=jnp.int32)
  block = (jnp.arange(total, dtype=jnp.int32)[None, :] <= q_pos[:, None])[None]
  if segment_ids is None:
    return block
  own = jax.lax.dynamic_slice_in_dim(segment_ids, start, length, axis=1)
  return block & (own[:, :, None] == segment_ids[:, None, :])
