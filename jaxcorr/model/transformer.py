"""`Transformer`: the decoder-only LM shared by policy, reference, critic and
rollout engine.

    tokens [B, S] -> embed -> L x DecoderLayer -> final RMSNorm
                  -> hidden [B, S, D] -> head [V, D] -> logits [B, S, V] fp32

The pieces are exposed separately because not every user wants logits:
`hidden_states` for a critic's value head or for chunked log-probs
(`jaxcorr.model.logprobs`), `head_weight` for the output projection (the
embedding itself when tied), `__call__` for full logits.

Packing: `segment_ids` [B, S] (any ints, one id per packed sequence) keep
attention inside each sequence; positions then restart at 0 in each segment
unless given. Decoding: `init_cache` and a `KVCache` passed to
`hidden_states` (prefill, then one or more tokens per step).

Layers are either a list (`scan_layers=False`) or one stacked module scanned
with `jax.lax.scan` (`scan_layers=True`: one layer compiled once, params
[L, ...] with logical axis `layers`); `remat` wraps each layer in
`jax.checkpoint`.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jaxcorr.model.config import TransformerConfig
from jaxcorr.model.layers import (
  DecoderLayer,
  RMSNorm,
  matmul_precision,
  param,
  rope_frequencies,
  rope_tables,
)
from jaxcorr.sharding import constrain

_REMAT_POLICY = {
  'full': jax.checkpoint_policies.nothing_saveable,
  'dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def mask_padded_vocab(
  logits: jax.Array, real_vocab_size: int | None
) -> jax.Array:
  """Sets logit columns >= `real_vocab_size` to -inf
  (docs/math/rollout_contract.md §1).

  Padding columns exist only for sharding or alignment; both the trainer and
  the engine must drop them, or every importance ratio is biased by the
  probability mass the padding absorbs.
  """
  v = logits.shape[-1]
  if real_vocab_size is None or real_vocab_size >= v:
    return logits
  real = jnp.arange(v) < real_vocab_size
  return jnp.where(real, logits, jnp.array(-jnp.inf, logits.dtype))


def entropy_terms(probs: jax.Array, logits: jax.Array) -> jax.Array:
  """`p·z` per column, 0 where z = -inf (p = 0 there; avoids 0·inf)."""
  finite = jnp.isfinite(logits)
  return probs * jnp.where(finite, logits, jnp.zeros((), logits.dtype))


@flax.struct.dataclass
class KVCache:
  """Keys/values of every layer for incremental decoding.

  k, v: [L, B, T, K, Dh]; segment_ids: [B, T] int32, 0 = empty slot;
  index: int32 scalar, the next slot to write (slots fill left to right,
  the same for all rows).
  """

  k: jax.Array
  v: jax.Array
  segment_ids: jax.Array
  index: jax.Array


def segment_positions(segment_ids: jax.Array) -> jax.Array:
  """Position of each token inside its packed segment, [B, S] int32.

  A segment is a run of equal ids; positions restart at 0 where the id
  changes.
  """
  s = segment_ids.shape[-1]
  idx = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), segment_ids.shape)
  first = jnp.concatenate(
    [
      jnp.ones_like(segment_ids[:, :1], dtype=bool),
      segment_ids[:, 1:] != segment_ids[:, :-1],
    ],
    axis=1,
  )
  start = jax.lax.cummax(jnp.where(first, idx, 0), axis=1)
  return idx - start


class Transformer(nnx.Module):
  """Llama 3 / Qwen2 / Qwen3 decoder (see `TransformerConfig`)."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    cfg = config
    self.embed = param(
      rngs, (cfg.vocab_size, cfg.hidden_size), ('vocab', 'embed'), cfg
    )
    if cfg.scan_layers:
      self.layers = _stacked_layers(cfg, rngs)
    else:
      self.layers = nnx.List(
        [DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)]
      )
    self.final_norm = RMSNorm(cfg.hidden_size, cfg)
    # Stored [V, D] like the embedding, so tied and untied share one path.
    self.lm_head = (
      None
      if cfg.tie_embeddings
      else param(
        rngs, (cfg.vocab_size, cfg.hidden_size), ('vocab', 'embed'), cfg
      )
    )

  # ----------------------------------------------------------- forward

  def head_weight(self) -> jax.Array:
    """Output projection [V, D] in param dtype (the embedding when tied)."""
    head = self.embed if self.lm_head is None else self.lm_head
    return head[...]

  def hidden_states(
    self,
    tokens: jax.Array,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    cache: KVCache | None = None,
  ) -> tuple[jax.Array, KVCache | None]:
    """tokens [B, S] -> (final-normed hidden [B, S, D] in compute dtype, cache).

    Without a cache: causal attention within each segment; `positions`
    default to `segment_positions(segment_ids)` (0..S-1 without segments).
    With a cache: the S tokens go to slots [index, index + S) and attend to
    every filled slot of their segment (default segment 1); `positions`
    default to index + [0, S) and must be given for left-padded prompts.
    """
    cfg = self.config
    b, s = tokens.shape
    tokens = constrain(tokens, ('batch', 'seq'))
    if cache is None:
      if segment_ids is None:
        idx = jnp.arange(s, dtype=jnp.int32)
        mask = (idx[:, None] >= idx[None, :])[None]
        if positions is None:
          positions = jnp.broadcast_to(idx, (b, s))
      else:
        causal = jnp.tril(jnp.ones((s, s), bool))[None]
        mask = causal & (segment_ids[:, :, None] == segment_ids[:, None, :])
        if positions is None:
          positions = segment_positions(segment_ids)
    else:
      mask, positions, cache = _cache_mask(cache, b, s, positions, segment_ids)

    x = jnp.take(self.embed[...], tokens, axis=0).astype(cfg.dtype)
    x = constrain(x, ('batch', 'seq', 'act_embed'))
    rope = rope_tables(
      positions,
      rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
    )
    kv = None if cache is None else (cache.k, cache.v)
    index = None if cache is None else cache.index
    x, kv = self._layers(x, rope, mask, kv, index)
    if cache is not None:
      cache = cache.replace(k=kv[0], v=kv[1], index=cache.index + s)
    return self.final_norm(x), cache

  def logits(self, hidden: jax.Array) -> jax.Array:
    """hidden [B, S, D] -> logits [B, S, V] float32 (fp32 accumulation).

    Columns past `config.real_vocab_size` (embedding padding) are -inf.
    """
    cfg = self.config
    out = jnp.einsum(
      'bsd,vd->bsv',
      hidden.astype(cfg.dtype),
      self.head_weight().astype(cfg.dtype),
      precision=matmul_precision(cfg),
      preferred_element_type=jnp.float32,
    )
    out = mask_padded_vocab(out, cfg.real_vocab_size)
    return constrain(out, ('batch', 'seq', 'act_vocab'))

  def __call__(
    self,
    tokens: jax.Array,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
  ) -> jax.Array:
    """tokens [B, S] -> logits [B, S, V] float32 (materialised whole; use
    `token_logprobs` when only the log-probs of given tokens are needed)."""
    h, _ = self.hidden_states(
      tokens, positions=positions, segment_ids=segment_ids
    )
    return self.logits(h)

  def init_cache(
    self, batch: int, max_len: int, dtype: jnp.dtype | None = None
  ) -> KVCache:
    """An empty cache for `batch` rows of up to `max_len` tokens."""
    cfg = self.config
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    dtype = dtype or cfg.dtype
    return KVCache(
      k=jnp.zeros(shape, dtype),
      v=jnp.zeros(shape, dtype),
      segment_ids=jnp.zeros((batch, max_len), jnp.int32),
      index=jnp.zeros((), jnp.int32),
    )

  # ------------------------------------------------------------ layers

  def _layers(self, x, rope, mask, kv, index):
    """Run every layer; kv is None or the stacked (k, v) [L, B, T, K, Dh]."""
    policy = _REMAT_POLICY.get(self.config.remat)

    def run(graphdef, state, x, kv_l):
      layer = nnx.merge(graphdef, state)
      return layer(x, rope, mask, kv_l, index)

    if self.config.scan_layers:
      graphdef, state = nnx.split(self.layers)

      def body(x, xs):
        return step(graphdef, xs[0], x, xs[1])

      step = run if policy is None else _checkpoint(run, policy)
      x, kv = jax.lax.scan(body, x, (state, kv))
      return x, kv
    new_kv = []
    for i, layer in enumerate(self.layers):
      kv_l = None if kv is None else (kv[0][i], kv[1][i])
      if policy is None:
        x, kv_l = layer(x, rope, mask, kv_l, index)
      else:
        graphdef, state = nnx.split(layer)
        x, kv_l = _checkpoint(run, policy)(graphdef, state, x, kv_l)
      new_kv.append(kv_l)
    if kv is None:
      return x, None
    return x, tuple(jnp.stack(t) for t in zip(*new_kv))


def _checkpoint(fn, policy):
  # graphdef (argument 0) is static structure, not an array.
  return jax.checkpoint(fn, policy=policy, static_argnums=(0,))


def _stacked_layers(cfg: TransformerConfig, rngs: nnx.Rngs) -> DecoderLayer:
  """One DecoderLayer whose params carry a leading [L] axis named 'layers'."""

  @nnx.split_rngs(splits=cfg.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs: nnx.Rngs) -> DecoderLayer:
    return DecoderLayer(cfg, rngs=rngs)

  layers = make(rngs)
  for _, v in nnx.iter_graph(layers):
    if isinstance(v, nnx.Param):
      v.set_metadata(logical_axes=('layers', *v.get_metadata()['logical_axes']))
  return layers


def _cache_mask(cache, b, s, positions, segment_ids):
  """Mask [B, S, T], positions [B, S] and the cache with this step's segment
  ids written, for S new tokens at slots [index, index + S)."""
  t = cache.segment_ids.shape[1]
  if segment_ids is None:
    segment_ids = jnp.ones((b, s), jnp.int32)
  seg = jax.lax.dynamic_update_slice(
    cache.segment_ids, segment_ids.astype(jnp.int32), (0, cache.index)
  )
  q_slot = cache.index + jnp.arange(s, dtype=jnp.int32)
  k_slot = jnp.arange(t, dtype=jnp.int32)
  mask = (k_slot[None, :] <= q_slot[:, None])[None]
  mask = (
    mask & (seg[:, None, :] == segment_ids[:, :, None]) & (seg != 0)[:, None]
  )
  if positions is None:
    positions = jnp.broadcast_to(q_slot, (b, s))
  return mask, positions, cache.replace(segment_ids=seg)
