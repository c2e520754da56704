"""`BatchedDecoding`: the batched, device-resident engine methods that
`rollout.decoder.Decoder` drives through `PolicyEngine`, apart from
JetStream's one-request API (jaxcorr/rollout/requests.py):

    prefill_batch(prompts, requests)   -> one forward per prompt, a first
                                          token per request (samples of a
                                          prompt share its prefill)
    insert_batch(prefix, state, slots) -> all requests in one scatter
    decode_chunk(state, stop_ids)      -> up to `chunk_steps` steps in one
                                          dispatch (`rollout.decode`)
    compact(state, rows)               -> a smaller batch of the live rows
    refresh_cache(state, contexts)     -> live rows' KV recomputed under the
                                          current weights (in-flight swaps)

Inputs are padded to buckets (`rollout.layout`), so each method compiles a
logarithmic number of shapes. The decode state belongs to the caller; the
weights are the engine's current ones (`PolicyWeights`) unless given.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcorr.rollout.decode import Programs
from jaxcorr.rollout.layout import Layout, bucket_of, pow2_buckets
from jaxcorr.rollout.policy_weights import PolicyWeights
from jaxcorr.rollout.state import (
  Chunk,
  DecodeState,
  Prefix,
  SamplingParams,
  pack_sampling,
)


class BatchedDecoding:
  """The batched engine methods (module docstring).

  Args:
    layout: the engine's sizes.
    programs: the engine's jitted device functions.
    weights: the engine's current weights (`refresh_cache` and
      `decode_chunk` read them at each call).
  """

  def __init__(
    self, layout: Layout, programs: Programs, weights: PolicyWeights
  ):
    self.layout, self.programs, self.weights = layout, programs, weights

  def prefill_batch(
    self,
    params: nnx.State,
    prompts: Sequence[Sequence[int]],
    source: Sequence[int],
    keys: jax.Array,
    sampling_params: SamplingParams,
  ) -> Prefix:
    """One forward over `prompts` (R token lists, checked by the caller),
    then a first token for each of M requests: request m draws from prompt
    `source[m]` with `keys[m]`. Prompts pad to the longest one's bucket and
    R to a power of two, M to N: one compilation per (bucket, R bucket).
    """
    r, m, n = len(prompts), len(source), self.layout.slots
    if not 0 < m <= n:
      raise ValueError(f'{m} requests: must be in [1, {n}] (the slots)')
    pb = self.layout.bucket(max(len(p) for p in prompts))
    rb = bucket_of(pow2_buckets(1, n), r)
    tokens = np.zeros((rb, pb), np.int32)
    lengths = np.ones((rb,), np.int32)
    for i, p in enumerate(prompts):
      tokens[i, : len(p)] = p
      lengths[i] = len(p)
    src = np.zeros((n,), np.int32)
    src[:m] = source
    keys = jnp.concatenate(
      [jnp.asarray(keys, jnp.uint32), jnp.zeros((n - m, 2), jnp.uint32)]
    )
    sp = jnp.tile(pack_sampling(sampling_params), (n, 1))
    prefix = self.programs.prefill(
      params, *self.layout.replicate(tokens, lengths, src, keys, sp)
    )
    return prefix.replace(prompt=self.layout.replicate(tokens)[0])

  def insert_batch(
    self,
    prefix: Prefix,
    decode_state: DecodeState,
    slots: Sequence[int],
    limits: Sequence[int],
    stop_ids: jax.Array,
  ) -> DecodeState:
    """Requests of a `prefill_batch` prefix into `slots` (one per request);
    limits: each request's token budget; stop_ids from `stop_array`."""
    n, m = self.layout.slots, len(slots)
    if any(not 0 <= s < n for s in slots):
      raise ValueError(f'slots {list(slots)} not all in [0, {n})')
    pad_slots = np.full((n,), n, np.int32)  # slot n: dropped
    pad_slots[:m] = slots
    pad_limits = np.zeros((n,), np.int32)
    pad_limits[:m] = limits
    return self.programs.insert(
      prefix,
      decode_state,
      *self.layout.replicate(pad_slots, pad_limits, stop_ids),
    )

  def compact(
    self, decode_state: DecodeState, rows: Sequence[int]
  ) -> DecodeState:
    """A decode state of len(rows) slots: slot i is old slot rows[i]. The
    driver shrinks the batch this way once the queue is empty and half
    the slots are done (one compilation per pair of sizes; `decode_chunk`
    takes any slot count). JetStream's `insert`/`generate` keep using
    full-size states."""
    n = decode_state.tokens.shape[0]
    if not rows or any(not 0 <= r < n for r in rows):
      raise ValueError(f'rows {list(rows)} must be non-empty, in [0, {n})')
    return self.programs.compact(
      decode_state, *self.layout.replicate(jnp.asarray(rows, jnp.int32))
    )

  def refresh_cache(
    self, decode_state: DecodeState, contexts: Sequence[Sequence[int] | None]
  ) -> DecodeState:
    """Recompute the KV cache of in-flight slots under the current weights
    (`decode.refill`): contexts[n] is slot n's prompt plus its sampled
    tokens but the newest (its `cache.index` tokens), None for a slot
    whose cache stays. One compilation per attention bucket."""
    n = decode_state.tokens.shape[0]
    if len(contexts) != n:
      raise ValueError(f'{len(contexts)} contexts for {n} slots')
    longest = max((len(c) for c in contexts if c), default=0)
    if not longest:
      return decode_state
    tokens = np.zeros((n, self.layout.attend_bucket(longest)), np.int32)
    live = np.zeros((n,), bool)
    for i, c in enumerate(contexts):
      if c:
        tokens[i, : len(c)] = c
        live[i] = True
    return self.programs.refill(
      self.weights.params,
      decode_state,
      *self.layout.replicate(tokens, live),
    )

  def decode_chunk(
    self,
    decode_state: DecodeState,
    stop_ids: jax.Array,
    *,
    exit_active: int = 0,
    attend_len: int | None = None,
    params: nnx.State | None = None,
  ) -> tuple[DecodeState, Chunk]:
    """Up to `chunk_steps` steps of every active slot in one dispatch
    (`rollout.decode.decode_chunk`); leaves early once at most
    `exit_active` slots are active. `attend_len` must cover every live
    row's last position in the chunk (`Layout.attend_bucket`; None: the
    whole cache). `params`: None for the current weights."""
    return self.programs.chunk(
      self.weights.params if params is None else params,
      decode_state,
      *self.layout.replicate(stop_ids, jnp.asarray(exit_active, jnp.int32)),
      num_steps=self.layout.chunk_steps,
      attend_len=attend_len or self.layout.max_target,
    )
