"""Exact mode: a batch- and position-invariant forward, so the rollout engine's
per-token log-probs equal the trainer's bit for bit (`rollout.exact`,
docs/rollout.md "Exact mode").

Why the two differ otherwise: a matmul's per-row result depends on how many
rows it has (XLA:CPU picks the GEMM blocking, hence the order of the sums
over the contracted axis, from the shape), and decoding runs N slots x 1
token where the trainer runs B x L tokens; attention over a cache bucket sums
over another key extent than attention over the whole row.

What this module does instead, for every token whatever its batch:

    token-wise ops     every projection, norm, RoPE and the head run on
                       fixed tiles of `TILE` tokens (`token_tiles`: the
                       tokens flattened, padded to a multiple of TILE, a
                       `lax.map` over [TILE, ...] pieces), so each token's
                       row goes through the same GEMM shape, at any row of
                       a tile (checked for M in 1..512, fp32 and bf16);
    attention          each query reads its own sequence's keys from a
                       per-row store [R, K, S, Dh] where position j sits at
                       key index j, in blocks of `KEY_BLOCK` keys at fixed
                       positions with an online softmax, up to the block of
                       the tile's last position: a block past a query's
                       position adds exact zeros, so the bits do not depend
                       on S or on how many blocks run (`_attend`); queries
                       in tiles of TILE as above;
    log-softmax        logits / τ and their logsumexp inside the head tile,
                       float32 (`exact_logits`); the engine's untruncated
                       draw happens there too (`exact_sample`).

The engine (jaxcorr/rollout/decode.py) decodes with `exact_hidden` over its
cache and samples with `exact_sample` (`exact_logits` when it truncates);
the trainer scores with `exact_token_logprobs` over stores of the same
extent. The cost: token-wise work padded to whole tiles (a decode step of
N < TILE live slots still computes TILE rows), attention in whole blocks
of KEY_BLOCK positions, an MoE layer's every expert per token.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcorr import sampling
from jaxcorr.model.layers import (
  apply_rope,
  matmul_precision,
  rope_frequencies,
  rope_tables,
)
from jaxcorr.model.moe import MoEBlock
from jaxcorr.model.quantized_weights import embed_rows, project
from jaxcorr.model.transformer import mask_padded_vocab

TILE = 64
"""Tokens per tile: every token-wise GEMM of exact mode is [TILE, D] x [D, F].
64 = a 64-slot engine's decode step in one tile (bench/exact.py: 8-64 cost
the same on the CPU bench model; 64 halves the loop trips of 32)."""

KEY_BLOCK = 32
"""Keys per attention block (`_attend`): a query's cost follows its
position in steps of KEY_BLOCK, not the store's extent."""

_NEG_INF = float(np.finfo(np.float32).min)

Store = tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]
"""Per-layer keys and values, (k, v), each a tuple of L arrays [R, K, S, Dh]:
row r's position j at key index j (the engine's cache layout)."""


def token_tiles(fn: Callable[..., Any], *xs: jax.Array, tile: int = TILE):
  """`fn` over `xs` ([M, ...] each) in [tile, ...] pieces, M padded with
  zeros to a multiple of `tile` (the padding rows' outputs are cut): each
  row's result does not depend on M or on where the row sits."""
  m = xs[0].shape[0]
  n = -(-m // tile)

  def split(x):
    x = jnp.pad(x, ((0, n * tile - m),) + ((0, 0),) * (x.ndim - 1))
    return x.reshape(n, tile, *x.shape[1:])

  out = jax.lax.map(lambda t: fn(*t), tuple(split(x) for x in xs))
  return jax.tree.map(lambda y: y.reshape(n * tile, *y.shape[2:])[:m], out)


def empty_store(cfg: Any, rows: int, extent: int) -> Store:
  """Zero keys/values for `rows` sequences of `extent` positions."""
  shape = (rows, cfg.num_kv_heads, extent, cfg.head_dim)
  zeros = tuple(jnp.zeros(shape, cfg.dtype) for _ in range(cfg.num_layers))
  return zeros, zeros


def _qkv(layer: Any, inv_freq: np.ndarray):
  """Tile fn: (x [t, D], pos [t]) -> q [t, H, Dh], k, v [t, K, Dh]."""

  def fn(x, pos):
    attn = layer.attn
    h = layer.attn_norm(x[None])
    q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    if attn.q_norm is not None:
      q, k = attn.q_norm(q), attn.k_norm(k)
    rope = rope_tables(pos[None], inv_freq)
    return apply_rope(q, rope)[0], apply_rope(k, rope)[0], v[0]

  return fn


def _attend(precision: Any, keys: jax.Array, values: jax.Array):
  """Tile fn: (q [t, H, Dh], pos [t], row [t]) -> [t, H, Dh], each query
  over its row's keys at indices <= pos, in blocks of `KEY_BLOCK` keys at
  fixed positions [b B, (b + 1) B), one block after another (an online
  softmax: running max m, sum l and Σ p v, rescaled by exp(m_old - m)),
  up to the block holding the tile's last position.

  Why blocks: every block is the same [t, K, B, Dh] computation whatever
  the store's extent S, and a block past a query's position adds exact
  zeros (its scores are masked, exp gives 0, the rescale is exp(0) = 1),
  so a query's bits do not depend on how many blocks its tile runs:
  attention costs the positions in use, not S (a prompt's prefill reads
  its prompt's blocks, not the cache length)."""
  width = keys.shape[2]

  def fetch(store, row, idx):  # [t, K, B, Dh]; indices past S are masked
    block = store.at[row[:, None], :, idx[None, :]].get(mode='clip')
    return jnp.moveaxis(block, 1, 2)

  def fn(q, pos, row):
    t, h, dh = q.shape
    kv = keys.shape[1]
    q = q.reshape(t, kv, h // kv, dh)

    def body(carry):
      b, m, total, acc = carry
      idx = b * KEY_BLOCK + jnp.arange(KEY_BLOCK)
      k = fetch(keys, row, idx).astype(q.dtype)
      v = fetch(values, row, idx).astype(q.dtype)
      scores = jnp.einsum(
        'tkgd,tksd->tkgs',
        q,
        k,
        precision=precision,
        preferred_element_type=jnp.float32,
      )
      keep = (idx <= pos[:, None]) & (idx < width)  # [t, B]
      scores = jnp.where(keep[:, None, None], scores * (dh**-0.5), _NEG_INF)
      new_m = jnp.maximum(m, jnp.max(scores, axis=-1))
      scale = jnp.exp(m - new_m)
      p = jnp.exp(scores - new_m[..., None])
      pv = jnp.einsum(
        'tkgs,tksd->tkgd',
        p.astype(v.dtype),
        v,
        precision=precision,
        preferred_element_type=jnp.float32,
      )
      total = total * scale + jnp.sum(p, axis=-1)
      return b + 1, new_m, total, acc * scale[..., None] + pv

    blocks = jnp.max(pos) // KEY_BLOCK + 1
    stat = jnp.full(q.shape[:3], _NEG_INF, jnp.float32)
    init = (jnp.int32(0), stat, jnp.zeros_like(stat))
    init += (jnp.zeros(q.shape, jnp.float32),)
    _, _, total, acc = jax.lax.while_loop(lambda c: c[0] < blocks, body, init)
    return (acc / total[..., None]).astype(q.dtype).reshape(t, h, dh)

  return fn


def _residual(layer: Any):
  """Tile fn: (x [t, D], attention out [t, H, Dh]) -> (the layer's output,
  an MoE layer's experts [t, k] or None). An MoE block runs every expert
  on every token (`moe_dispatch='dense'`): the grouped dispatch's GEMM
  shapes depend on which tokens share the tile."""

  def fn(x, o):
    x = x[None] + layer.attn.o_proj(o[None])
    h = layer.mlp_norm(x)
    if not isinstance(layer.mlp, MoEBlock):
      return (x + layer.mlp(h))[0], None
    y, stats = layer.mlp(h, dispatch='dense')
    return (x + y)[0], stats.experts[0]

  return fn


def _layer(layer, x, pos, row, kv, inv_freq, precision):
  """One decoder layer over tokens [M]; writes their k/v into the store
  (rows >= R are dropped: padding tokens) before attending. Returns (x,
  the store, experts [M, k] or None)."""
  q, k, v = token_tiles(_qkv(layer, inv_freq), x, pos)
  keys, values = (
    s.at[row, :, pos].set(new.astype(s.dtype), mode='drop')
    for s, new in zip(kv, (k, v))
  )
  o = token_tiles(_attend(precision, keys, values), q, pos, row)
  x, experts = token_tiles(_residual(layer), x, o)
  return x, (keys, values), experts


def exact_hidden(
  model: Any,
  tokens: jax.Array,
  pos: jax.Array,
  row: jax.Array,
  kv: Store,
) -> tuple[jax.Array, Store, jax.Array | None]:
  """tokens, pos, row [M] (a token, its position in its sequence, its
  sequence's row of the store; row >= R: padding, neither stored nor
  read) -> (hidden [M, D] before the final norm, the store with every
  token's keys/values written, the MoE layers' experts [M, L_moe, k] or
  None for a dense policy)."""
  cfg = model.config
  inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
  precision = matmul_precision(cfg)
  x = embed_rows(model.embed.get_value(), tokens, cfg.dtype)
  new_k, new_v, experts = [], [], []
  for layer, k, v in zip(model.layer_list(), *kv):
    x, (k, v), e = _layer(layer, x, pos, row, (k, v), inv_freq, precision)
    new_k.append(k)
    new_v.append(v)
    if e is not None:
      experts.append(e)
  routing = jnp.stack(experts, axis=1) if experts else None
  return x, (tuple(new_k), tuple(new_v)), routing


def exact_logits(
  model: Any, hidden: jax.Array, temperature: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """hidden [M, D] (before the final norm), temperature [M] -> (z [M, V] =
  logits / τ float32, logsumexp(z) [M]): log q(y) = z[y] - lse, the same
  bits whoever asks (the engine's truncated sampler draws from z)."""
  head = functools.partial(_head, model)
  return token_tiles(head, hidden, temperature.astype(jnp.float32))


def exact_sample(
  model: Any, hidden: jax.Array, temperature: jax.Array, keys: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """hidden [M, D], temperature [M], keys [M, 2] -> (y [M] drawn from
  softmax(z) over the whole vocabulary, z[y] - lse): the token is drawn
  inside the head tile (`sampling.exp_blocks`, `draw_blocks`: the
  untruncated sampler's one pass), so no [M, V] array leaves the tile.
  The normaliser stays `_head`'s logsumexp, not the draw's block sums:
  reusing those changes how XLA fuses (and sums) the exp, and the lse
  would no longer be the trainer's bits."""

  def fn(h, temp, key):
    z, lse = _head(model, h, temp)
    _, e, size, sums = sampling.exp_blocks(z)
    y = sampling.draw_blocks(key, e, size, sums)
    return y, sampling.nonpositive(_at(z, y) - lse)

  return token_tiles(fn, hidden, temperature.astype(jnp.float32), keys)


def exact_logprobs_at(
  model: Any, hidden: jax.Array, temperature: jax.Array, targets: jax.Array
) -> jax.Array:
  """`exact_logits`'s z[y] − lse at `targets` [M], picked inside each tile:
  the same bits without the [M, V] logits (the trainer's π_old)."""

  def fn(h, temp, y):
    z, lse = _head(model, h, temp)
    return sampling.nonpositive(_at(z, y) - lse)

  return token_tiles(fn, hidden, temperature.astype(jnp.float32), targets)


def _at(z: jax.Array, y: jax.Array) -> jax.Array:
  """z [t, V], y [t] -> z[i, y_i]."""
  return jnp.take_along_axis(z, y[:, None], axis=-1)[:, 0]


def _head(model: Any, h: jax.Array, temp: jax.Array):
  """Tile fn: (h [t, D], τ [t]) -> (z = logits / τ [t, V], logsumexp z)."""
  cfg = model.config
  head = model.embed if model.lm_head is None else model.lm_head
  logits = project(
    'bsd,vd->bsv',
    model.final_norm(h[None]),
    head.get_value(),
    cfg.dtype,
    precision=matmul_precision(cfg),
    preferred_element_type=jnp.float32,
  )[0]
  z = mask_padded_vocab(logits, cfg.real_vocab_size) / temp[:, None]
  return z, jax.nn.logsumexp(z, axis=-1)


def exact_token_logprobs(
  model: Any,
  tokens: jax.Array,
  segment_ids: jax.Array,
  temperature: jax.Array,
  extent: int,
) -> tuple[jax.Array, jax.Array | None]:
  """The trainer's side: (log q(tokens[:, i + 1] | ...) [B, L - 1], the
  MoE routing [B, L, L_moe, k] or None) of rows `tokens` [B, L] whose real
  tokens have `segment_ids` != 0 (one sequence per row, prompts possibly
  left-padded), temperature [B], over stores of `extent` positions (the
  engine's cache length). Off-segment positions hold garbage."""
  b, length = tokens.shape
  real = segment_ids != 0
  pos = jnp.cumsum(real, axis=1, dtype=jnp.int32) - 1
  if length > extent:
    raise ValueError(
      f'rows of {length} tokens exceed the exact extent {extent}'
    )
  row = jnp.where(real, jnp.arange(b, dtype=jnp.int32)[:, None], b)
  flat = lambda x: x.reshape(-1)  # noqa: E731
  hidden, _, experts = exact_hidden(
    model,
    flat(tokens),
    flat(jnp.maximum(pos, 0)),
    flat(row),
    empty_store(model.config, b, extent),
  )
  temp = jnp.broadcast_to(temperature[:, None], (b, length))
  nxt = flat(jnp.pad(tokens[:, 1:], ((0, 0), (0, 1))))
  logp = exact_logprobs_at(model, hidden, flat(temp), nxt)
  if experts is not None:
    experts = experts.reshape(b, length, *experts.shape[1:])
  return logp.reshape(b, length)[:, :-1], experts
