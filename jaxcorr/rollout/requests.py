"""`RequestDecoding`: JetStream's one-request-at-a-time engine API, as
`PolicyEngine` (jaxcorr/rollout/engine.py) offers it to JetStream's server:

    prefill(prompt padded to a bucket) -> Prefix (KV cache L x [1,K,Pb,Dh],
                                                  first token + log-probs)
    insert(prefix, state, slot)        -> the slot's cache rows, sampling
                                          params and RNG key replaced
    generate(params, state)            -> one token for every slot

plus the tokenizer JetStream asks for. The caller passes the params (JetStream
holds them); a request that brings no sampling key gets the next key of the
engine's seed, so a server's requests draw distinct streams.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcorr.rollout.decode import Programs
from jaxcorr.rollout.layout import Layout, stop_array
from jaxcorr.rollout.state import (
  DecodeState,
  LogProbResultTokens,
  Prefix,
  SamplingParams,
  pack_sampling,
)


class RequestDecoding:
  """JetStream's one-request engine methods (module docstring).

  Args:
    layout: the engine's sizes.
    programs: the engine's jitted device functions.
    tokenizer: the JetStream tokenizer `build_tokenizer` returns.
    default_sampling: settings for requests that bring none.
    seed: the root of the keys of requests that bring none.
  """

  def __init__(
    self,
    layout: Layout,
    programs: Programs,
    *,
    tokenizer: Any,
    default_sampling: SamplingParams,
    seed: int,
  ):
    self.layout, self.programs = layout, programs
    self.tokenizer = tokenizer
    self.default_sampling = default_sampling
    self._root_key = jax.random.PRNGKey(seed)
    self._served = 0  # requests that came without a key

  def pad_prompt(self, prompt: Any) -> tuple[jax.Array, int]:
    """Token ids -> (right-padded [bucket] int32, true length)."""
    prompt = np.asarray(prompt, np.int32).reshape(-1)
    n = prompt.size
    padded = np.zeros(self.layout.bucket(n), np.int32)
    padded[:n] = prompt
    return jnp.asarray(padded), n

  def prefill(
    self,
    *,
    params: nnx.State,
    existing_prefix: Prefix | None = None,
    padded_tokens: jax.Array,
    true_length: int,
    sampling_params: SamplingParams | None = None,
    key: jax.Array | None = None,
  ) -> Prefix:
    """KV cache and first token of one prompt (`padded_tokens` [Pb])."""
    if existing_prefix is not None:
      raise NotImplementedError('prefix caching is not supported')
    # One compilation per padded length: `pad_prompt`'s buckets (the same
    # as JetStream's `pad_tokens` for a power-of-two max_prefill_length).
    pb = padded_tokens.shape[-1]
    max_prefill = self.layout.max_prefill
    if pb > max_prefill:
      raise ValueError(f'padded length {pb} > max_prefill_length={max_prefill}')
    if not 0 < true_length <= pb:
      raise ValueError(f'true_length {true_length} not in [1, {pb}]')
    sp = sampling_params or self.default_sampling
    if key is None:
      key = jax.random.fold_in(self._root_key, self._served)
      self._served += 1
    return self.programs.prefill(
      params,
      *self.layout.replicate(
        jnp.asarray(padded_tokens, jnp.int32).reshape(1, pb),
        jnp.asarray([true_length], jnp.int32),
        jnp.zeros((1,), jnp.int32),
        jnp.asarray(key, jnp.uint32).reshape(1, 2),
        pack_sampling(sp)[None],
      ),
    )

  def insert(
    self, prefix: Prefix, decode_state: DecodeState, slot: int
  ) -> DecodeState:
    """Place `prefix` in `slot` (a traced index: one compile per bucket)."""
    n = self.layout.slots
    if not 0 <= slot < n:
      raise ValueError(f'slot {slot} not in [0, {n})')
    # JetStream's orchestrator counts tokens itself: no limit, no stops.
    return self.programs.insert(
      prefix,
      decode_state,
      *self.layout.replicate(
        jnp.asarray([slot], jnp.int32),
        jnp.asarray([self.layout.max_target], jnp.int32),
        stop_array(()),
      ),
    )

  def generate(
    self, params: nnx.State, decode_state: DecodeState
  ) -> tuple[DecodeState, LogProbResultTokens]:
    """One token for every slot (empty slots compute garbage, ignored)."""
    return self.programs.generate(params, decode_state)
