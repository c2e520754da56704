"""JetStream's one-request-at-a-time half of `PolicyEngine`
(jaxcorr/rollout/engine.py):

    prefill(prompt padded to a bucket) -> Prefix (KV cache L x [1,K,Pb,Dh],
                                                  first token + log-probs)
    insert(prefix, state, slot)        -> the slot's cache rows, sampling
                                          params and RNG key replaced
    generate(params, state)            -> one token for every slot

plus the tokenizer and the sizes `engine_api.Engine` asks for.
`RequestDecoding` is a mixin, like `rollout.batched.BatchedDecoding`:
`PolicyEngine.__init__` builds the jitted functions and sizes it reads.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jetstream.engine import tokenizer_pb2

from jaxcorr.rollout import decode
from jaxcorr.rollout.batched import bucket_of
from jaxcorr.rollout.state import (
  DecodeState,
  LogProbResultTokens,
  Prefix,
  SamplingParams,
  pack_sampling,
)


class RequestDecoding:
  """JetStream's one-request engine methods (module docstring); mixed into
  `PolicyEngine`, whose constructor sets `_n`, `_max_prefill`,
  `_max_target`, `_root_key`, `_served`, `_tokenizer`, `_mesh`, `buckets`,
  `default_sampling`, the `_*_jit` functions and `_replicate`."""

  # ------------------------------------------------------------- prefill

  def bucket(self, length: int) -> int:
    """The padded prefill length for a prompt of `length` tokens."""
    if not 0 < length <= self._max_prefill:
      raise ValueError(
        f'prompt length {length} must be in [1, max_prefill_length='
        f'{self._max_prefill}]'
      )
    return bucket_of(self.buckets, length)

  def pad_prompt(self, prompt: Any) -> tuple[jax.Array, int]:
    """Token ids -> (right-padded [bucket] int32, true length)."""
    prompt = np.asarray(prompt, np.int32).reshape(-1)
    n = prompt.size
    padded = np.zeros(self.bucket(n), np.int32)
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
    if pb > self._max_prefill:
      raise ValueError(
        f'padded length {pb} > max_prefill_length={self._max_prefill}'
      )
    if not 0 < true_length <= pb:
      raise ValueError(f'true_length {true_length} not in [1, {pb}]')
    sp = sampling_params or self.default_sampling
    if key is None:
      key = jax.random.fold_in(self._root_key, self._served)
      self._served += 1
    return self._prefill_jit(
      params,
      *self._replicate(
        jnp.asarray(padded_tokens, jnp.int32).reshape(1, pb),
        jnp.asarray([true_length], jnp.int32),
        jnp.zeros((1,), jnp.int32),
        jnp.asarray(key, jnp.uint32).reshape(1, 2),
        pack_sampling(sp)[None],
      ),
    )

  # -------------------------------------------------------------- insert

  def init_decode_state(self, *args, **kwargs) -> DecodeState:
    """Empty slots: zero caches of max_target_length tokens each."""
    del args, kwargs
    state = decode.init_state(
      self.config, self._n, self._max_target, pack_sampling(SamplingParams())
    )
    return self._replicate(state)[0]

  def insert(
    self, prefix: Prefix, decode_state: DecodeState, slot: int
  ) -> DecodeState:
    """Place `prefix` in `slot` (a traced index: one compile per bucket)."""
    if not 0 <= slot < self._n:
      raise ValueError(f'slot {slot} not in [0, {self._n})')
    # JetStream's orchestrator counts tokens itself: no limit, no stops.
    return self._insert_jit(
      prefix,
      decode_state,
      *self._replicate(
        jnp.asarray([slot], jnp.int32),
        jnp.asarray([self._max_target], jnp.int32),
        self.stop_array(()),
      ),
    )

  # ------------------------------------------------------------ generate

  def generate(
    self, params: nnx.State, decode_state: DecodeState
  ) -> tuple[DecodeState, LogProbResultTokens]:
    """One token for every slot (empty slots compute garbage, ignored)."""
    return self._generate_jit(params, decode_state)

  @staticmethod
  def _generate_fn(graphdef, params, state):
    advance = jnp.ones_like(state.active)
    state, tok, lp, lpt, _ = decode.step(graphdef, params, state, advance)
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

  # ----------------------------------------------- tokenizer, properties

  def get_prefix_destination_sharding(self) -> Any:
    return None  # prefill and generate share the engine's devices

  def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
    return tokenizer_pb2.TokenizerParameters(path='jaxcorr-ids')

  def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters):
    del metadata
    return self._tokenizer

  @property
  def max_concurrent_decodes(self) -> int:
    return self._n

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self._max_prefill

  @property
  def max_target_length(self) -> int:
    return self._max_target

  @property
  def mesh(self) -> jax.sharding.Mesh | None:
    return self._mesh

  @property
  def colocated_cpus(self) -> None:
    return None
