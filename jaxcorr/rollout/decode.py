"""The rollout engine's device functions and their jitted forms
(`Programs`, one set per `PolicyEngine`):

    prefill(R prompts [R, Pb], M requests -> their prompt rows)
        one forward over the R prompts; each request draws its first token
        from its prompt's last logits with its own key  -> Prefix
    insert(prefix, state, slots [M])
        scatter each request's prompt KV into its slot (per layer, in
        place; slot N = dropped, so M pads to a fixed size)
    refill(state, context [N, L], live [N])
        recompute the KV of the live slots' contexts under new weights
        (an in-flight weight update with kv_on_update='recompute')
    step(state)            one token for every slot
    generate(state)        `step` packed as JetStream's result type
    decode_chunk(state)    up to C steps in one `lax.while_loop`: sample,
                           both log-probs, stop tokens and length limits on
                           device, results in [N, C] buffers; leaves early
                           when every slot is done or enough are free
    take_rows(state, rows) the state of some slots (a smaller batch)

`sample_rows` is the one place a token is drawn (prefill and decode both
call it), so a per-token output such as the kept set goes there.

An MoE policy also records its routing (docs/moe.md): prefill the experts
of every prompt position (`Prefix.routing`), each step those of the token
it feeds (`Chunk.routing`), from the same forward that samples, so each
token's routing is that of the weights that computed it. Dense policies
trace exactly the code they always did.

Attention in a step covers the first `attend_len` cache slots only (a
static bucket >= the longest live row): the seam where a ragged / paged
attention kernel would go (docs/rollout.md).

Exact mode (`exact_extent` > 0, the cache length; `rollout.exact`): prefill,
step and refill run `jaxcorr.model.exact` instead (fixed token tiles,
attention in fixed key blocks up to the tile's last position, so
`attend_len` is unused), tokens are drawn from its logits and logp_full is
its log-softmax: the bits the trainer's exact scoring gives.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcorr import sampling
from jaxcorr.model import KVCache
from jaxcorr.model import exact as exact_lib
from jaxcorr.model.logprobs import replay_logprobs
from jaxcorr.model.moe import NO_EXPERT, routing_shape
from jaxcorr.model.quantized_cache import QuantizedKV
from jaxcorr.rollout import kept_set as kept_set_lib
from jaxcorr.rollout.state import (
  Chunk,
  DecodeState,
  LogProbResultTokens,
  Prefix,
)


def sample_rows(keys, logits, sp, kept_capacity: int = 0):
  """keys [N, 2], logits [N, V] fp32, sp [N, 4] (temperature, top_k, top_p,
  min_p) -> token [N] int32, logp_full [N], logp_truncated [N], kept: the
  `KeptSet` [N] the token was drawn from (width `kept_capacity`, static) or
  None when 0 (no extra work: `logprob_mode='replay'` only). With a kept
  set, logp_truncated is renormalised over the stored set ∪ {y}
  (`replay_logprobs`): the truncated value unless the set was capped, and
  exactly what the trainer recomputes."""
  temp, top_k, top_p, min_p = (
    sp[:, 0], sp[:, 1].astype(jnp.int32), sp[:, 2], sp[:, 3]
  )  # fmt: skip
  tok, lp, lpt = sampling.sample(keys, logits, temp, top_k, top_p, min_p)
  kept = None
  if kept_capacity:
    kept = kept_set_lib.kept_set(
      logits,
      capacity=kept_capacity,
      temperature=temp,
      top_k=top_k,
      top_p=top_p,
      min_p=min_p,
    )
    lpt, _ = replay_logprobs(
      logits, tok, kept.ids, kept.count, temperature=temp
    )
  return tok, lp, lpt, kept


def sample_exact(keys, model, hidden, sp):
  """`sample_rows` for exact mode: hidden [N, D] (before the final norm)
  -> the same outputs (no kept set), the token drawn from z = logits / τ
  of `exact_logits` and logp_full = z[y] - logsumexp(z), bit for bit the
  trainer's (`exact_token_logprobs`). Without truncation (the RL default)
  the draw happens inside the head tile (`exact_sample`: one pass over V,
  as the plain sampler); with it, the sampler's kept set is built from z
  and logp_truncated keeps its log of the kept mass on top of logp_full."""
  temp, top_k, top_p, min_p = sp[:, 0], sp[:, 1], sp[:, 2], sp[:, 3]

  def truncated():
    z, lse = exact_lib.exact_logits(model, hidden, temp)
    unit = sp.at[:, 0].set(1.0)  # z is already divided by τ
    tok, lp, lpt, _ = sample_rows(keys, z, unit)
    exact = jnp.take_along_axis(z, tok[:, None], axis=-1)[:, 0] - lse
    exact = sampling.nonpositive(exact)  # as exact_logprobs_at clamps
    return tok, exact, sampling.nonpositive(lpt - lp + exact)

  def untruncated():
    tok, exact = exact_lib.exact_sample(model, hidden, temp, keys)
    return tok, exact, exact

  truncates = jnp.any((top_k > 0) | (top_p < 1.0) | (min_p > 0.0))
  tok, exact, lpt = jax.lax.cond(truncates, truncated, untruncated)
  return tok, exact, lpt, None


def exact_forward(model, tokens, store, index, extent):
  """Exact forward of right-padded `tokens` [R, L] at positions index +
  [0, L) of the R rows of `store` ([R, K, extent, Dh] per layer; None:
  empty) -> (hidden [R, L, D] before the final norm, the store, the MoE
  routing [R, L, L_moe, k] or None)."""
  r, length = tokens.shape
  if store is None:
    store = exact_lib.empty_store(model.config, r, extent)
  pos = index[:, None] + jnp.arange(length, dtype=jnp.int32)
  row = jnp.broadcast_to(jnp.arange(r, dtype=jnp.int32)[:, None], (r, length))
  hidden, store, experts = exact_lib.exact_hidden(
    model,
    tokens.reshape(-1),
    pos.reshape(-1),
    row.reshape(-1),
    store,
  )
  if experts is not None:
    experts = experts.reshape(r, length, *experts.shape[1:])
  return hidden.reshape(r, length, -1), store, experts


def init_state(
  cfg, n: int, t: int, sp_row: jax.Array, kv_dtype: Any = None
) -> DecodeState:
  """N empty slots with caches of T tokens each, in `kv_dtype` (None: the
  model's; int8 / fp8: a `QuantizedKV` per layer)."""
  shape = (n, cfg.num_kv_heads, t, cfg.head_dim)
  kv_dtype = jnp.dtype(kv_dtype or cfg.dtype)

  def zeros():
    if not jnp.issubdtype(kv_dtype, jnp.floating) or kv_dtype.itemsize == 1:
      return tuple(
        QuantizedKV.zeros(shape, kv_dtype) for _ in range(cfg.num_layers)
      )
    return tuple(jnp.zeros(shape, kv_dtype) for _ in range(cfg.num_layers))

  cache = KVCache(
    k=zeros(), v=zeros(), segment_ids=None, index=jnp.zeros((n,), jnp.int32)
  )
  return DecodeState(
    cache=cache,
    tokens=jnp.zeros((n,), jnp.int32),
    steps=jnp.zeros((n,), jnp.int32),
    keys=jnp.zeros((n, 2), jnp.uint32),
    sampling=jnp.tile(sp_row, (n, 1)),
    limit=jnp.zeros((n,), jnp.int32),
    active=jnp.zeros((n,), bool),
  )


def prefill(
  graphdef,
  params,
  tokens,
  lengths,
  source,
  keys,
  sp,
  *,
  kept_capacity=0,
  exact_extent=0,
) -> Prefix:
  """tokens [R, Pb] right-padded, lengths [R]; source [M], keys [M, 2],
  sp [M, 4] -> Prefix (with the first tokens' kept sets if
  `kept_capacity`)."""
  model = nnx.merge(graphdef, params)
  r, pb = tokens.shape
  step0 = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, 0)
  if exact_extent:
    zero = jnp.zeros((r,), jnp.int32)
    hidden, (k, v), experts = exact_forward(
      model, tokens, None, zero, exact_extent
    )
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)
    tok, lp, lpt, _ = sample_exact(step0, model, last[source, 0], sp)
    cut = lambda x: tuple(c[:, :, :pb] for c in x)  # noqa: E731
    cache = KVCache(k=cut(k), v=cut(v), segment_ids=None, index=lengths)
    routing = None if experts is None else experts[source]
    return Prefix(cache, source, tok, lp, lpt, keys, sp, routing=routing)
  cache = model.init_cache(r, pb)
  cache = cache.replace(segment_ids=None)
  # Causal attention: the right padding after a prompt's last token changes
  # nothing before it, and decoding overwrites it from index = length on.
  hidden, cache, stats = model.routed_hidden_states(tokens, cache=cache)
  last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)
  logits = model.logits(last)[:, 0]  # [R, V] float32
  tok, lp, lpt, kept = sample_rows(step0, logits[source], sp, kept_capacity)
  cache = cache.replace(index=lengths)
  routing = None if stats is None else stats.experts[source]
  return Prefix(
    cache, source, tok, lp, lpt, keys, sp, kept=kept, routing=routing
  )


def insert(prefix, state, slots, limit, stop_ids) -> DecodeState:
  """Requests [M] of `prefix` into `slots` [M] (N drops the request);
  limit [M] their token budgets; a request whose first token is a stop
  token or that may have only one token starts inactive."""
  src = prefix.source
  pb = prefix.cache.k[0].shape[2]

  def put_rows(dst, rows):
    if isinstance(dst, QuantizedKV):
      return dst.put_rows(rows[src], slots)
    rows = rows[src].astype(dst.dtype)
    return dst.at[slots, :, :pb].set(rows, mode='drop')

  def put(dst, x):
    return dst.at[slots].set(x.astype(dst.dtype), mode='drop')

  cache = state.cache
  cache = KVCache(
    k=tuple(map(put_rows, cache.k, prefix.cache.k)),
    v=tuple(map(put_rows, cache.v, prefix.cache.v)),
    segment_ids=None,
    index=put(cache.index, prefix.cache.index[src]),
  )
  live = (limit > 1) & ~_is_stop(prefix.token, stop_ids)
  return DecodeState(
    cache=cache,
    tokens=put(state.tokens, prefix.token),
    steps=put(state.steps, jnp.ones_like(src)),
    keys=put(state.keys, prefix.key),
    sampling=put(state.sampling, prefix.sampling),
    limit=put(state.limit, limit),
    active=put(state.active, live),
  )


def refill(
  graphdef, params, state, context, live, exact_extent=0
) -> DecodeState:
  """context [N, L] right-padded (each live slot's prompt and sampled
  tokens but the newest, which has no cache entry yet: `cache.index`
  tokens), live [N] bool -> the state with those slots' cache positions
  [0, L) recomputed by the model `params` hold; other slots unchanged.

  One forward like `prefill`: causal attention makes the right padding
  invisible to the real positions, and decoding overwrites it."""
  model = nnx.merge(graphdef, params)
  n, length = context.shape
  if exact_extent:
    zero = jnp.zeros((n,), jnp.int32)
    _, (k, v), _ = exact_forward(model, context, None, zero, exact_extent)
    cut = lambda x: tuple(c[:, :, :length] for c in x)  # noqa: E731
    fresh = KVCache(k=cut(k), v=cut(v), segment_ids=None, index=None)
  else:
    fresh = model.init_cache(n, length).replace(segment_ids=None)
    _, fresh = model.hidden_states(context, cache=fresh)
  keep = live[:, None, None, None]

  def put(dst, new):
    if isinstance(dst, QuantizedKV):
      return dst.blend_prefix(new, live)
    old = dst[:, :, :length]
    return dst.at[:, :, :length].set(
      jnp.where(keep, new.astype(dst.dtype), old)
    )

  cache = state.cache
  return state.replace(
    cache=cache.replace(
      k=tuple(map(put, cache.k, fresh.k)), v=tuple(map(put, cache.v, fresh.v))
    )
  )


def _is_stop(tokens, stop_ids):
  """tokens [N], stop_ids [S] (padded with -1) -> [N] bool."""
  return jnp.any(tokens[:, None] == stop_ids[None, :], axis=1)


def step(
  graphdef,
  params,
  state,
  advance,
  attend_len=None,
  kept_capacity=0,
  exact_extent=0,
):
  """One token for every slot. advance [N] bool: the slots whose position,
  step count and last token move on (others compute and are ignored).

  Returns (state, token [N], logp [N], logp_truncated [N], kept: a
  `KeptSet` [N] or None, see `sample_rows`, routing: the fed tokens'
  experts [N, L_moe, k] or None for a dense policy). In exact mode the
  step attends over the whole cache (`attend_len` unused)."""
  model = nnx.merge(graphdef, params)
  keys = jax.vmap(jax.random.fold_in)(state.keys, state.steps)
  if exact_extent:
    cache = state.cache
    hidden, (k, v), experts = exact_forward(
      model, state.tokens[:, None], (cache.k, cache.v), cache.index, 0
    )
    cache = cache.replace(k=k, v=v)
    tok, lp, lpt, kept = sample_exact(keys, model, hidden[:, 0], state.sampling)
  else:
    hidden, cache, stats = model.routed_hidden_states(
      state.tokens[:, None], cache=state.cache, attend_len=attend_len
    )
    experts = None if stats is None else stats.experts
    logits = model.logits(hidden)[:, 0]  # [N, V] float32
    tok, lp, lpt, kept = sample_rows(
      keys, logits, state.sampling, kept_capacity
    )
  step_on = advance.astype(jnp.int32)
  state = state.replace(
    cache=cache.replace(index=state.cache.index + step_on),
    tokens=jnp.where(advance, tok, state.tokens),
    steps=state.steps + step_on,
  )
  routing = None if experts is None else experts[:, 0]
  return state, tok, lp, lpt, kept, routing


def decode_chunk(
  graphdef,
  params,
  state,
  stop_ids,
  exit_active,
  *,
  num_steps,
  attend_len,
  kept_capacity=0,
  exact_extent=0,
):
  """Up to `num_steps` decode steps on device. Leaves the loop early once
  at most `exit_active` slots are still active (0: when all are done).
  With `kept_capacity` C > 0 the chunk also holds each token's kept set.

  Returns (state, Chunk)."""
  n, c = state.tokens.shape[0], kept_capacity
  buf = (
    jnp.zeros((n, num_steps), jnp.int32),
    jnp.zeros((n, num_steps), jnp.float32),
    jnp.zeros((n, num_steps), jnp.float32),
  )
  if c:
    buf += (
      jnp.full((n, num_steps, c), kept_set_lib.PAD_ID, jnp.int32),
      jnp.zeros((n, num_steps), jnp.int32),
      jnp.zeros((n, num_steps), bool),
    )
  cfg = nnx.merge(graphdef, params).config
  moe = routing_shape(cfg)
  if moe is not None:
    layers, k, _ = moe
    buf += (jnp.full((n, num_steps, layers, k), NO_EXPERT, jnp.int32),)

  def cond(carry):
    state, _, c = carry
    busy = jnp.sum(state.active.astype(jnp.int32))
    return (c < num_steps) & (busy > exit_active)

  def body(carry):
    state, buf, c = carry
    live = state.active
    state, tok, lp, lpt, kept, routing = step(
      graphdef, params, state, live, attend_len, kept_capacity, exact_extent
    )
    new = (tok, lp, lpt)
    if kept is not None:
      new += (kept.ids, kept.count, kept.capped)
    if routing is not None:
      new += (jnp.where(live[:, None, None], routing, NO_EXPERT),)
    buf = tuple(
      jax.lax.dynamic_update_index_in_dim(b, x, c, axis=1)
      for b, x in zip(buf, new)
    )
    done = _is_stop(tok, stop_ids) | (state.steps >= state.limit)
    return state.replace(active=live & ~done), buf, c + 1

  steps0 = state.steps
  state, buf, c = jax.lax.while_loop(cond, body, (state, buf, jnp.int32(0)))
  # A slot is live for a prefix of the chunk's steps: its count is how many
  # steps it advanced.
  counts = state.steps - steps0
  kept = kept_set_lib.KeptSet(*buf[3:6]) if kept_capacity else None
  routing = buf[-1] if moe is not None else None
  return state, Chunk(
    *buf[:3],
    counts=counts,
    active=state.active,
    steps=c,
    kept=kept,
    routing=routing,
  )


def generate(
  graphdef, params, state, exact_extent=0
) -> tuple[DecodeState, LogProbResultTokens]:
  """JetStream's `generate`: one `step` of every slot, the token, its
  validity, the step count and both log-probs (bitcast to int32) in one
  `LogProbResultTokens` array (one host copy)."""
  advance = jnp.ones_like(state.active)
  state, tok, lp, lpt, _, _ = step(
    graphdef, params, state, advance, exact_extent=exact_extent
  )
  n = tok.shape[0]
  bits = jax.lax.bitcast_convert_type(jnp.stack([lp, lpt], 1), jnp.int32)
  data = jnp.concatenate(
    [tok[:, None], jnp.ones((n, 1), jnp.int32), state.steps[:, None], bits],
    1,
  )
  result = LogProbResultTokens(
    data=data,
    tokens_idx=(0, 1),
    valid_idx=(1, 2),
    length_idx=(2, 3),
    samples_per_slot=1,
  )
  return state, result


def take_rows(state: DecodeState, rows: jax.Array) -> DecodeState:
  """The decode state of slots `rows`."""
  return jax.tree.map(lambda x: x[rows], state)


class Programs(NamedTuple):
  """The jitted device functions of one engine (`jit_programs`); each
  compiles once per input shape. Decode states are donated: the cache is
  updated in place. `graphdef`: the model graph they run (what a caller
  compiling its own function over the engine's weights merges them into)."""

  prefill: Any
  insert: Any
  generate: Any
  compact: Any
  refill: Any
  chunk: Any
  graphdef: nnx.GraphDef


def jit_programs(
  graphdef: nnx.GraphDef, kept_capacity: int, exact_extent: int = 0
) -> Programs:
  """The functions above over one model graph. `kept_capacity` and
  `exact_extent` (0: off; else the cache length) are static: replay or
  exact mode on or off is one compilation per engine, never per call."""
  g, kept, ex = graphdef, kept_capacity, dict(exact_extent=exact_extent)
  return Programs(
    prefill=jax.jit(functools.partial(prefill, g, kept_capacity=kept, **ex)),
    insert=jax.jit(insert, donate_argnums=(1,)),
    generate=jax.jit(functools.partial(generate, g, **ex), donate_argnums=(1,)),
    compact=jax.jit(take_rows),
    refill=jax.jit(functools.partial(refill, g, **ex), donate_argnums=(1,)),
    chunk=jax.jit(
      functools.partial(decode_chunk, g, kept_capacity=kept, **ex),
      donate_argnums=(1,),
      static_argnames=('num_steps', 'attend_len'),
    ),
    graphdef=g,
  )
