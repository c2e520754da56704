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
`hidden_states` (prefill, then one or more tokens per step). The cache holds
one array per layer, so a step writes each layer's new keys/values in place
(a stacked [L, ...] array would be sliced and re-stacked, copying the whole
cache every token); rows may sit at different positions (`index` [B]) and a
step may attend over only a prefix of the cache (`attend_len`).

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

from jaxcorr.model.attention import CausalSegments
from jaxcorr.model.config import TransformerConfig
from jaxcorr.model.layers import (
  DecoderLayer,
  RMSNorm,
  matmul_precision,
  param,
  rope_frequencies,
  rope_tables,
)
from jaxcorr.model.moe import MoEDecoderLayer, RouterStats, stack_stats
from jaxcorr.model.projection import PROJECTION
from jaxcorr.model.quantized_weights import embed_rows, project
from jaxcorr.sharding import constrain

_REMAT_POLICY = {
  'full': jax.checkpoint_policies.nothing_saveable,
  # The projections are `custom_vjp` calls, not dots, to the policy: they
  # are saved by name (jaxcorr/model/projection.py).
  'dots': jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    jax.checkpoint_policies.save_only_these_names(PROJECTION),
  ),
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

  k, v: tuples of L arrays [B, K, T, Dh], one per layer; segment_ids: [B, T]
  int32, 0 = empty slot, or None (every slot before a row's write index is
  its own: the rollout engine's layout); index: int32 scalar (the next slot
  to write, the same for all rows) or [B] (one per row).
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  segment_ids: jax.Array | None
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
      moe = set(cfg.moe_layers)
      self.layers = nnx.List(
        [
          (MoEDecoderLayer if i in moe else DecoderLayer)(cfg, rngs=rngs)
          for i in range(cfg.num_layers)
        ]
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
    attend_len: int | None = None,
  ) -> tuple[jax.Array, KVCache | None]:
    """tokens [B, S] -> (final-normed hidden [B, S, D] in compute dtype, cache).

    Without a cache: causal attention within each segment; `positions`
    default to `segment_positions(segment_ids)` (0..S-1 without segments).
    With a cache: the S tokens go to slots [index, index + S) and attend to
    every filled slot of their segment (default segment 1); `positions`
    default to index + [0, S) and must be given for left-padded prompts.
    `attend_len` (static) bounds attention to the first slots of the cache:
    the caller guarantees index + S <= attend_len (the rollout engine picks
    it from a few buckets covering the longest live row).
    """
    h, cache, _ = self.routed_hidden_states(
      tokens,
      positions=positions,
      segment_ids=segment_ids,
      cache=cache,
      attend_len=attend_len,
    )
    return h, cache

  def routed_hidden_states(
    self,
    tokens: jax.Array,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    cache: KVCache | None = None,
    attend_len: int | None = None,
    replay: jax.Array | None = None,
    token_mask: jax.Array | None = None,
  ) -> tuple[jax.Array, KVCache | None, RouterStats | None]:
    """`hidden_states` plus the routing of the MoE layers (None if dense).

    replay: [B, S, L_moe, k] int expert ids to route by (`jaxcorr.model.moe.NO_EXPERT`
    rows route freely), or None; token_mask: [B, S] bool, the tokens the
    load-balancing statistics count (default: all).
    """
    cfg = self.config
    b, s = tokens.shape
    tokens = constrain(tokens, ('batch', 'seq'))
    if cache is None:
      # Kept as segment ids: a fused kernel takes them (model.attention).
      mask = CausalSegments(segment_ids, s)
      if positions is None and segment_ids is None:
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
      elif positions is None:
        positions = segment_positions(segment_ids)
    else:
      mask, positions, cache = _cache_mask(
        cache, b, s, positions, segment_ids, attend_len
      )

    x = embed_rows(self.embed.get_value(), tokens, cfg.dtype)
    x = constrain(x, ('batch', 'seq', 'act_embed'))
    rope = rope_tables(
      positions,
      rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
    )
    kv = None if cache is None else (cache.k, cache.v)
    index = None if cache is None else cache.index
    moe = (replay, token_mask)
    x, kv, stats = self._layers(x, rope, mask, kv, index, attend_len, moe)
    if cache is not None:
      cache = cache.replace(k=kv[0], v=kv[1], index=cache.index + s)
    return self.final_norm(x), cache, stats

  def logits(self, hidden: jax.Array) -> jax.Array:
    """hidden [B, S, D] -> logits [B, S, V] float32 (fp32 accumulation).

    Columns past `config.real_vocab_size` (embedding padding) are -inf.
    """
    cfg = self.config
    head = self.embed if self.lm_head is None else self.lm_head
    out = project(
      'bsd,vd->bsv',
      hidden,
      head.get_value(),  # a `QuantizedWeight` in a quantized engine
      cfg.dtype,
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
    shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    dtype = dtype or cfg.dtype
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
    return KVCache(
      k=zeros,
      v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
      segment_ids=jnp.zeros((batch, max_len), jnp.int32),
      index=jnp.zeros((), jnp.int32),
    )

  # ------------------------------------------------------------ layers

  def _layers(self, x, rope, mask, kv, index, attend_len=None, moe=None):
    """Run every layer; kv is None or per-layer (k, v) tuples; moe is
    (replay [B, S, L_moe, k] or None, token_mask or None). Returns
    (x, kv, stacked routing of the MoE layers or None)."""
    replay, token_mask = moe or (None, None)
    if kv is not None:
      return self._cached_layers(
        x, rope, mask, kv, index, attend_len, replay, token_mask
      )
    policy = _REMAT_POLICY.get(self.config.remat)

    def run(graphdef, state, x, replay):
      layer = nnx.merge(graphdef, state)
      out = _call_layer(
        layer, x, rope, mask, None, None, None, replay, token_mask
      )
      return out[0], out[2]

    if self.config.scan_layers:
      graphdef, state = nnx.split(self.layers)
      step = run if policy is None else _checkpoint(run, policy)
      per_layer = None if replay is None else jnp.moveaxis(replay, 2, 0)

      def body(x, xs):
        return step(graphdef, xs[0], x, xs[1])

      x, stats = jax.lax.scan(body, x, (state, per_layer))
      return x, None, _scanned_stats(stats)
    stats, j = [], 0
    for layer in self.layers:
      rep = None
      if isinstance(layer, MoEDecoderLayer) and replay is not None:
        rep = replay[:, :, j]
      if policy is None:
        x, _, st = _call_layer(
          layer, x, rope, mask, None, None, None, rep, token_mask
        )
      else:
        graphdef, state = nnx.split(layer)
        x, st = _checkpoint(run, policy)(graphdef, state, x, rep)
      if st is not None:
        stats.append(st)
        j += 1
    return x, None, stack_stats(stats) if stats else None

  def layer_list(self) -> list:
    """The layers as a list of modules (a scanned stack sliced per layer)."""
    if not self.config.scan_layers:
      return list(self.layers)
    graphdef, state = nnx.split(self.layers)
    return [
      nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
      for i in range(self.config.num_layers)
    ]

  def _cached_layers(
    self, x, rope, mask, kv, index, attend_len, replay=None, token_mask=None
  ):
    """Decoding: an unrolled loop over layers, each with its own cache
    arrays, so every write lands in place (no remat: nothing to
    differentiate)."""
    new_k, new_v, stats = [], [], []
    for layer, k, v in zip(self.layer_list(), *kv):
      rep = None
      if isinstance(layer, MoEDecoderLayer) and replay is not None:
        rep = replay[:, :, len(stats)]
      x, (k, v), st = _call_layer(
        layer, x, rope, mask, (k, v), index, attend_len, rep, token_mask
      )
      new_k.append(k)
      new_v.append(v)
      if st is not None:
        stats.append(st)
    kv = (tuple(new_k), tuple(new_v))
    return x, kv, stack_stats(stats) if stats else None


def _call_layer(layer, x, rope, mask, kv, index, attend_len, replay, tmask):
  """(x, cache, routing or None) from a dense or an MoE layer."""
  if isinstance(layer, MoEDecoderLayer):
    return layer(x, rope, mask, kv, index, attend_len, replay, tmask)
  x, kv = layer(x, rope, mask, kv, index, attend_len)
  return x, kv, None


def _scanned_stats(stats: RouterStats | None) -> RouterStats | None:
  """Scan stacks per-layer stats on axis 0; experts go to axis 2."""
  if stats is None:
    return None
  return stats.replace(
    experts=jnp.moveaxis(stats.experts, 0, 2),
    natural=jnp.moveaxis(stats.natural, 0, 2),
  )


def _checkpoint(fn, policy):
  # graphdef (argument 0) is static structure, not an array.
  return jax.checkpoint(fn, policy=policy, static_argnums=(0,))


def _stacked_layers(cfg: TransformerConfig, rngs: nnx.Rngs) -> DecoderLayer:
  """One DecoderLayer whose params carry a leading [L] axis named 'layers'."""

  @nnx.split_rngs(splits=cfg.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs: nnx.Rngs) -> DecoderLayer:
    if cfg.num_experts:  # every layer is MoE (checked by the config)
      return MoEDecoderLayer(cfg, rngs=rngs)
    return DecoderLayer(cfg, rngs=rngs)

  layers = make(rngs)
  for _, v in nnx.iter_graph(layers):
    if isinstance(v, nnx.Param):
      v.set_metadata(logical_axes=('layers', *v.get_metadata()['logical_axes']))
  return layers


def _cache_mask(cache, b, s, positions, segment_ids, attend_len=None):
  """Mask [B, S, attend_len or T], positions [B, S] and the cache with this
  step's segment ids written, for S new tokens at slots [index, index + S).
  """
  t = cache.k[0].shape[2] if attend_len is None else attend_len
  index = cache.index
  per_row = jnp.ndim(index) == 1
  offsets = jnp.arange(s, dtype=jnp.int32)
  q_slot = index[:, None] + offsets if per_row else index + offsets
  q_slot = jnp.broadcast_to(q_slot, (b, s))
  k_slot = jnp.arange(t, dtype=jnp.int32)
  mask = k_slot[None, None, :] <= q_slot[:, :, None]
  if positions is None:
    positions = q_slot
  if cache.segment_ids is None:
    if segment_ids is not None:
      raise ValueError(
        'segment_ids need a cache with segment_ids (init_cache makes one)'
      )
    return mask, positions, cache
  if segment_ids is None:
    segment_ids = jnp.ones((b, s), jnp.int32)
  seg = _write_ids(cache.segment_ids, segment_ids.astype(jnp.int32), index)
  seg_t = seg[:, :t]
  mask &= (seg_t[:, None, :] == segment_ids[:, :, None]) & (seg_t != 0)[:, None]
  return mask, positions, cache.replace(segment_ids=seg)


def _write_ids(ids, new, index):
  if jnp.ndim(index) == 0:
    return jax.lax.dynamic_update_slice(ids, new, (0, index))
  return jax.vmap(lambda r, x, i: jax.lax.dynamic_update_slice(r, x, (i,)))(
    ids, new, index
  )
