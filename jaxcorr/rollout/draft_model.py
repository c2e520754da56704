"""The separate draft checkpoint of speculative decoding (draft='model',
docs/speculative.md): a smaller `Transformer` with the policy's token ids,
its own KV cache in the decode state, filled at insert.

The draft's cache (`DecodeState.draft`) has the engine's slots and cache
length and is kept at the target's write index: insert prefills it with
each request's prompt (the batched path's `Prefix.prompt`), and each round
writes the tokens the draft fed (x0, d_1..d_k), of which the accepted
prefix stays below the new index. Requests without a prompt in their
prefix (JetStream's one-request `prefill`) and tokens written into the
target's cache by other paths (a multi-turn continuation) leave stale
draft entries: the draft proposes worse, sampling stays exact (q is what
the draft drew from, whatever it attended to).

The draft is fixed: weight syncs swap the policy's params only. It is
loaded once (jaxcorr/train/rollouts/draft.py) and its acceptance falls as
the policy moves away from it (bench/speculative.py measures by how much).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax.numpy as jnp
from flax import nnx

from jaxcorr.model import KVCache


@flax.struct.dataclass
class DraftModel:
  """A loaded draft, a jit argument of the speculative chunk and insert:
  its graph and config (static) and its params."""

  graphdef: Any = flax.struct.field(pytree_node=False)
  config: Any = flax.struct.field(pytree_node=False)
  params: Any = None

  @classmethod
  def of(cls, model: Any) -> DraftModel:
    """The `DraftModel` of an in-memory `Transformer`."""
    graphdef, params = nnx.split(model)
    return cls(graphdef, model.config, params)


def empty_cache(cfg: Any, slots: int, length: int) -> KVCache:
  """Zero draft caches: one [slots, K, length, Dh] array per draft layer
  in the draft's dtype."""
  shape = (slots, cfg.num_kv_heads, length, cfg.head_dim)
  zeros = lambda: tuple(  # noqa: E731
    jnp.zeros(shape, cfg.dtype) for _ in range(cfg.num_layers)
  )
  index = jnp.zeros((slots,), jnp.int32)
  return KVCache(k=zeros(), v=zeros(), segment_ids=None, index=index)


def prefill(draft: DraftModel, cache: KVCache, prefix, slots) -> KVCache:
  """The draft's keys/values of `prefix.prompt` [R, Pb] written into the
  rows `slots` [M] of `cache` (request m from prompt prefix.source[m]; a
  slot out of range drops the request). One forward over the R prompts:
  causal attention makes the right padding invisible, and decoding
  overwrites it."""
  model = nnx.merge(draft.graphdef, draft.params)
  prompt, src = prefix.prompt, prefix.source
  r, pb = prompt.shape
  fresh = model.init_cache(r, pb).replace(segment_ids=None)
  _, fresh = model.hidden_states(prompt, cache=fresh)

  def put(dst, rows):
    return dst.at[slots, :, :pb].set(rows[src].astype(dst.dtype), mode='drop')

  index = cache.index.at[slots].set(prefix.cache.index[src], mode='drop')
  return KVCache(
    k=tuple(map(put, cache.k, fresh.k)),
    v=tuple(map(put, cache.v, fresh.v)),
    segment_ids=None,
    index=index,
  )
