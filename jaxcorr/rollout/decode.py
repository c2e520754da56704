"""The rollout engine's device functions, jitted by `PolicyEngine`:

    prefill(R prompts [R, Pb], M requests -> their prompt rows)
        one forward over the R prompts; each request draws its first token
        from its prompt's last logits with its own key  -> Prefix
    insert(prefix, state, slots [M])
        scatter each request's prompt KV into its slot (per layer, in
        place; slot N = dropped, so M pads to a fixed size)
    step(state)            one token for every slot (JetStream `generate`)
    decode_chunk(state)    up to C steps in one `lax.while_loop`: sample,
                           both log-probs, stop tokens and length limits on
                           device, results in [N, C] buffers; leaves early
                           when every slot is done or enough are free

`sample_rows` is the one place a token is drawn (prefill and decode both
call it), so a per-token output such as the kept set goes there.

Attention in a step covers the first `attend_len` cache slots only (a
static bucket >= the longest live row): the seam where a ragged / paged
attention kernel would go (docs/rollout.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcorr import sampling
from jaxcorr.model import KVCache
from jaxcorr.rollout.state import Chunk, DecodeState, Prefix


def sample_rows(keys, logits, sp):
  """keys [N, 2], logits [N, V] fp32, sp [N, 4] (temperature, top_k, top_p,
  min_p) -> token [N] int32, logp_full [N], logp_truncated [N]."""
  return sampling.sample(
    keys, logits, sp[:, 0], sp[:, 1].astype(jnp.int32), sp[:, 2], sp[:, 3]
  )


def init_state(cfg, n: int, t: int, sp_row: jax.Array) -> DecodeState:
  """N empty slots with caches of T tokens each."""
  shape = (n, cfg.num_kv_heads, t, cfg.head_dim)

  def zeros():
    return tuple(jnp.zeros(shape, cfg.dtype) for _ in range(cfg.num_layers))

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


def prefill(graphdef, params, tokens, lengths, source, keys, sp) -> Prefix:
  """tokens [R, Pb] right-padded, lengths [R]; source [M], keys [M, 2],
  sp [M, 4] -> Prefix."""
  model = nnx.merge(graphdef, params)
  r, pb = tokens.shape
  cache = model.init_cache(r, pb)
  cache = cache.replace(segment_ids=None)
  # Causal attention: the right padding after a prompt's last token changes
  # nothing before it, and decoding overwrites it from index = length on.
  hidden, cache = model.hidden_states(tokens, cache=cache)
  last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)
  logits = model.logits(last)[:, 0]  # [R, V] float32
  step0 = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, 0)
  tok, lp, lpt = sample_rows(step0, logits[source], sp)
  cache = cache.replace(index=lengths)
  return Prefix(cache, source, tok, lp, lpt, keys, sp)


def insert(prefix, state, slots, limit, stop_ids) -> DecodeState:
  """Requests [M] of `prefix` into `slots` [M] (N drops the request);
  limit [M] their token budgets; a request whose first token is a stop
  token or that may have only one token starts inactive."""
  src = prefix.source
  pb = prefix.cache.k[0].shape[2]

  def put_rows(dst, rows):
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


def _is_stop(tokens, stop_ids):
  """tokens [N], stop_ids [S] (padded with -1) -> [N] bool."""
  return jnp.any(tokens[:, None] == stop_ids[None, :], axis=1)


def step(graphdef, params, state, advance, attend_len=None):
  """One token for every slot. advance [N] bool: the slots whose position,
  step count and last token move on (others compute and are ignored).

  Returns (state, token [N], logp [N], logp_truncated [N])."""
  model = nnx.merge(graphdef, params)
  hidden, cache = model.hidden_states(
    state.tokens[:, None], cache=state.cache, attend_len=attend_len
  )
  logits = model.logits(hidden)[:, 0]  # [N, V] float32
  keys = jax.vmap(jax.random.fold_in)(state.keys, state.steps)
  tok, lp, lpt = sample_rows(keys, logits, state.sampling)
  step_on = advance.astype(jnp.int32)
  state = state.replace(
    cache=cache.replace(index=state.cache.index + step_on),
    tokens=jnp.where(advance, tok, state.tokens),
    steps=state.steps + step_on,
  )
  return state, tok, lp, lpt


def decode_chunk(
  graphdef, params, state, stop_ids, exit_active, *, num_steps, attend_len
):
  """Up to `num_steps` decode steps on device. Leaves the loop early once
  at most `exit_active` slots are still active (0: when all are done).

  Returns (state, Chunk)."""
  n = state.tokens.shape[0]
  buf = (
    jnp.zeros((n, num_steps), jnp.int32),
    jnp.zeros((n, num_steps), jnp.float32),
    jnp.zeros((n, num_steps), jnp.float32),
  )

  def cond(carry):
    state, _, c = carry
    busy = jnp.sum(state.active.astype(jnp.int32))
    return (c < num_steps) & (busy > exit_active)

  def body(carry):
    state, buf, c = carry
    live = state.active
    state, tok, lp, lpt = step(graphdef, params, state, live, attend_len)
    buf = tuple(
      jax.lax.dynamic_update_index_in_dim(b, x, c, axis=1)
      for b, x in zip(buf, (tok, lp, lpt))
    )
    done = _is_stop(tok, stop_ids) | (state.steps >= state.limit)
    return state.replace(active=live & ~done), buf, c + 1

  steps0 = state.steps
  state, buf, c = jax.lax.while_loop(cond, body, (state, buf, jnp.int32(0)))
  # A slot is live for a prefix of the chunk's steps: its count is how many
  # steps it advanced.
  counts = state.steps - steps0
  return state, Chunk(*buf, counts=counts, active=state.active, steps=c)
