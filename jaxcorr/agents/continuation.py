"""Continuing a trajectory on its slot: the environment's tokens prefilled
onto the slot's existing KV cache, and the next turn's first token drawn.

When an agent turn ends, its slot keeps its cache: every token but the
last sampled one (which, as in decoding, has no cache entry yet). The
continuation runs one forward over `[last agent token, env tokens...]`
(right-padded to a bucket) from the slot's write index, writes their keys
and values in place, and samples the next turn's first token from the last
real position, exactly as a prompt prefill does. Nothing of the history is
recomputed: a 4-turn trajectory costs its prompt's prefill, its decode
steps and one short forward per turn, against a prefill of the whole
growing history per turn without it (bench/agents.py measures both).

Several slots continue in one dispatch (their rows gathered, run, and
scattered back; padded to the slot count, one compilation per length and
attention bucket), so trajectories at different turns batch together with
the slots still decoding (`jaxcorr.agents.driver`). The sampled token uses
the same draw as a prefill: fold_in(turn_key, 0), then the decode steps
fold_in(turn_key, t), so a continued turn and a turn re-prefilled from
the whole history sample the same tokens from the same logits (the test
of tests/agents/test_driver.py).

The forward writes a padded bucket of positions from the write index, so
the engine's cache needs that many positions of headroom past the longest
trajectory (`cache_headroom`); the padding positions are never attended
(causal mask) and later writes overwrite them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcorr.model import KVCache
from jaxcorr.rollout.decode import exact_forward, sample_exact, sample_rows
from jaxcorr.rollout.engine import PolicyEngine
from jaxcorr.rollout.layout import bucket_of, pow2_buckets
from jaxcorr.rollout.state import DecodeState

_MIN_BUCKET = 16


def extension_buckets(longest: int) -> tuple[int, ...]:
  """Padded lengths of a continuation's input (one compilation each)."""
  return pow2_buckets(_MIN_BUCKET, max(_MIN_BUCKET, longest))


def cache_headroom(longest: int) -> int:
  """Cache positions a slot needs past its trajectory for continuations of
  up to `longest` tokens (the largest bucket)."""
  return extension_buckets(longest)[-1]


def extend(
  graphdef,
  params,
  state: DecodeState,
  slots,
  tokens,
  lengths,
  keys,
  limits,
  stop_ids,
  *,
  attend_len,
  exact_extent=0,
):
  """slots [M] (N = padding, dropped), tokens [M, L] right-padded, lengths
  [M], keys [M, 2] the next turn's keys, limits [M] its token budgets ->
  (state, token [M], logp [M], logp_truncated [M]); in exact mode
  (`exact_extent` > 0) the engine's exact forward and sampling."""
  model = nnx.merge(graphdef, params)
  n = state.tokens.shape[0]
  rows = jnp.minimum(slots, n - 1)  # padding rows read any slot
  cache = state.cache
  sub = KVCache(
    k=tuple(k[rows] for k in cache.k),
    v=tuple(v[rows] for v in cache.v),
    segment_ids=None,
    index=cache.index[rows],
  )
  step0 = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, 0)
  sp = state.sampling[rows]
  if exact_extent:
    hidden, (k, v), _ = exact_forward(
      model, tokens, (sub.k, sub.v), sub.index, 0
    )
    sub = sub.replace(k=k, v=v)
  else:
    hidden, sub = model.hidden_states(tokens, cache=sub, attend_len=attend_len)
  last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)
  if exact_extent:
    tok, lp, lpt, _ = sample_exact(step0, model, last[:, 0], sp)
  else:
    tok, lp, lpt, _ = sample_rows(step0, model.logits(last)[:, 0], sp)

  def put(dst, x):
    return dst.at[slots].set(x.astype(dst.dtype), mode='drop')

  stop = jnp.any(tok[:, None] == stop_ids[None, :], axis=1)
  state = state.replace(
    cache=cache.replace(
      k=tuple(map(put, cache.k, sub.k)),
      v=tuple(map(put, cache.v, sub.v)),
      index=put(cache.index, cache.index[rows] + lengths),
    ),
    tokens=put(state.tokens, tok),
    steps=put(state.steps, jnp.ones_like(slots)),
    keys=put(state.keys, keys),
    limit=put(state.limit, limits),
    active=put(state.active, (limits > 1) & ~stop),
  )
  return state, tok, lp, lpt


class Continuation:
  """`extend` compiled over one engine's model graph.

  Args:
    engine: the engine whose decode states it continues (its weights are
      read at each call).
  """

  def __init__(self, engine: PolicyEngine):
    if engine.kept_set_capacity:
      raise ValueError(
        "multi-turn rollouts record no kept sets: logprob_mode='replay' is "
        'not supported with config.agent.environment'
      )
    self.engine = engine
    # The engine's own graph: a LoRA engine's weights do not fit a plain
    # Transformer's.
    self._extend = jax.jit(
      functools.partial(
        extend,
        engine.programs.graphdef,
        exact_extent=engine.layout.exact_extent,
      ),
      donate_argnums=(1,),
      static_argnames=('attend_len',),
    )

  def __call__(
    self,
    state: DecodeState,
    slots: Sequence[int],
    inputs: Sequence[Sequence[int]],
    keys: np.ndarray,
    limits: Sequence[int],
    stop_ids: jax.Array,
    cached: Sequence[int],
  ):
    """Continue `slots` with `inputs` (each: the last agent token, then
    the environment's ids); `cached[m]`: the slot's write index (tokens in
    its cache); `keys` [M, 2] and `limits` the next turns'. Returns
    (state, a host `(token, logp, logp_truncated)` of [M] arrays, still on
    device)."""
    engine = self.engine
    layout = engine.layout
    m = len(slots)
    n = layout.slots
    mb = n  # one compilation per (length, attention) bucket
    longest = max(len(x) for x in inputs)
    lb = bucket_of(extension_buckets(longest), longest)
    reach = max(c for c in cached) + lb
    if reach > layout.max_target:
      raise ValueError(
        f'a continuation reaches cache position {reach} > max_target_length='
        f'{layout.max_target}: build the engine with cache_headroom'
      )
    tokens = np.zeros((mb, lb), np.int32)
    lengths = np.ones((mb,), np.int32)
    pad_slots = np.full((mb,), n, np.int32)
    pad_keys = np.zeros((mb, 2), np.uint32)
    pad_limits = np.zeros((mb,), np.int32)
    for i, x in enumerate(inputs):
      tokens[i, : len(x)] = x
      lengths[i] = len(x)
    pad_slots[:m] = slots
    pad_keys[:m] = keys
    pad_limits[:m] = limits
    state, tok, lp, lpt = self._extend(
      engine.params,
      state,
      *layout.replicate(
        pad_slots, tokens, lengths, pad_keys, pad_limits, stop_ids
      ),
      attend_len=layout.attend_bucket(reach),
    )
    return state, (tok, lp, lpt)
