"""`PolicyEngine`: the jaxcorr `Transformer` behind JetStream's `Engine` API,
with the contract's per-token log-probs (`docs/math/rollout_contract.md`).

JetStream's API, one request or one step at a time:

    prefill(prompt padded to a bucket) -> Prefix (KV cache L x [1,K,Pb,Dh],
                                                  first token + log-probs)
    insert(prefix, state, slot)        -> the slot's cache rows, sampling
                                          params and RNG key replaced
    generate(params, state)            -> one token for every slot

(a mixin in jaxcorr/rollout/requests.py) and the batched, device-resident
path the decoder uses (prefill_batch, insert_batch, decode_chunk, compact,
refresh_cache), a mixin in jaxcorr/rollout/batched.py. This module holds
the constructor (the jitted functions both mixins call) and the weights.

Per-slot positions: the decode state holds one cache array per layer with
a slot axis ([N, K, T, Dh]) and a write index per slot, and the model's
own cached forward (`Transformer.hidden_states`) takes that per-row index,
so the transformer math stays in `jaxcorr.model` and each step writes its
keys/values in place. Prompts are right-padded inside their bucket; the
write index starts at the true length, so decoding overwrites the padding.

RNG: token t of a request is drawn with fold_in(request_key, t), so a
request's tokens do not depend on its slot or its neighbours.

Log-probs travel in `LogProbResultTokens`: JetStream's `ResultTokens` with
two float32 columns (full and truncated log-prob) bitcast into its int32
data array, so one host copy still carries everything.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jetstream.engine import engine_api

from jaxcorr.model import Transformer
from jaxcorr.rollout import decode
from jaxcorr.rollout.batched import BatchedDecoding, pow2_buckets, take_rows
from jaxcorr.rollout.requests import RequestDecoding
from jaxcorr.rollout.state import (
  Chunk,
  DecodeState,
  LogProbResultTokens,
  Prefix,
  SamplingParams,
)
from jaxcorr.rollout.tokenizer import IdTokenizer
from jaxcorr.sharding import param_shardings

_MIN_BUCKET = 16

__all__ = [
  'Chunk',
  'DecodeState',
  'LogProbResultTokens',
  'PolicyEngine',
  'Prefix',
  'SamplingParams',
]


class PolicyEngine(BatchedDecoding, RequestDecoding, engine_api.Engine):
  """JetStream engine over a jaxcorr `Transformer` (see module docstring).

  Args:
    model: the policy; its params become version 0 (`load_params`).
    max_concurrent_decodes: decode slots N.
    max_prefill_length: longest prompt; prompts are padded to power-of-two
      buckets up to it (one compilation per bucket).
    max_target_length: cache length per slot, prompt + response.
    mesh: reshard params onto this mesh (None: default device).
    dtype: inference dtype for params and compute (e.g. jnp.bfloat16;
      None: the model's). Logits and log-probs are float32 regardless.
    tokenizer: a JetStream tokenizer (default: `IdTokenizer`).
    default_sampling: settings for requests that bring none (the JetStream
      server's); each such request gets the next key of `seed`.
    decode_chunk: most decode steps per dispatch of `decode_chunk` (the
      host reads results and refills slots between dispatches).
    min_attend_bucket: smallest attention bucket; decode attends over the
      first 16, 32, ... (powers of two times it) cache slots, whichever
      covers the longest live row, up to max_target_length.
    kept_set_capacity: C > 0 records, per generated token, the kept set it
      was sampled from (`rollout/kept_set.py`, width C) for
      `logprob_mode='replay'`; 0 (default) records nothing.
  """

  def __init__(
    self,
    model: Transformer,
    *,
    max_concurrent_decodes: int,
    max_prefill_length: int,
    max_target_length: int,
    mesh: jax.sharding.Mesh | None = None,
    dtype: Any = None,
    tokenizer: Any = None,
    default_sampling: SamplingParams | None = None,
    seed: int = 0,
    decode_chunk: int = 32,
    min_attend_bucket: int = 32,
    kept_set_capacity: int = 0,
  ):
    if max_prefill_length > max_target_length:
      raise ValueError(
        f'max_prefill_length={max_prefill_length} exceeds '
        f'max_target_length={max_target_length}'
      )
    if not 0 <= kept_set_capacity <= model.config.vocab_size:
      raise ValueError(
        f'kept_set_capacity={kept_set_capacity}; allowed: 0 (off) or an '
        f'int in [1, vocab_size={model.config.vocab_size}]'
      )
    if decode_chunk < 1 or min_attend_bucket < 1:
      raise ValueError(
        f'decode_chunk={decode_chunk} and min_attend_bucket='
        f'{min_attend_bucket} must be >= 1'
      )
    cfg = model.config
    if dtype is not None:
      cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    self.config = cfg
    self._n = max_concurrent_decodes
    self._max_prefill = max_prefill_length
    self._max_target = max_target_length
    self.decode_chunk_steps = decode_chunk
    self._mesh = mesh
    self._tokenizer = tokenizer or IdTokenizer(cfg.vocab_size)
    self.default_sampling = default_sampling or SamplingParams()
    self._root_key = jax.random.PRNGKey(seed)
    self._served = 0  # requests that came without a key
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    self._graphdef, abstract_state = nnx.split(abstract)
    self._shardings = (
      None if mesh is None else param_shardings(abstract_state, mesh)
    )
    self.buckets = pow2_buckets(_MIN_BUCKET, max_prefill_length)
    self.attend_buckets = pow2_buckets(
      min(min_attend_bucket, max_target_length), max_target_length
    )
    g = self._graphdef
    # Static: replay on or off is one compilation per engine, never per call.
    self.kept_set_capacity = kept = kept_set_capacity
    self._prefill_jit = jax.jit(
      functools.partial(decode.prefill, g, kept_capacity=kept)
    )
    self._insert_jit = jax.jit(decode.insert, donate_argnums=(1,))
    self._generate_jit = jax.jit(
      functools.partial(self._generate_fn, g), donate_argnums=(1,)
    )
    self._compact_jit = jax.jit(take_rows)
    self._refill_jit = jax.jit(
      functools.partial(decode.refill, g), donate_argnums=(1,)
    )
    self._chunk_jit = jax.jit(
      functools.partial(decode.decode_chunk, g, kept_capacity=kept),
      donate_argnums=(1,),
      static_argnames=('num_steps', 'attend_len'),
    )
    self.params = self.load_params(model)
    self.policy_version = 0

  # ------------------------------------------------------------ params

  def load_params(self, params: Any = None, *args, **kwargs) -> nnx.State:
    """Trainer params (a `Transformer` or its `nnx.State`) cast to the
    engine dtype and placed on the engine mesh; no argument: the engine's
    current params (what JetStream's server asks for)."""
    del args, kwargs
    if params is None:
      return self.params
    if isinstance(params, nnx.Module):
      params = nnx.state(params)
    dtype = self.config.param_dtype

    def cast(x):
      if jnp.issubdtype(x.dtype, jnp.floating):
        return x.astype(dtype)
      return x

    params = jax.tree.map(cast, params)
    if self._shardings is not None:
      params = jax.device_put(params, self._shardings)
    return params

  def update_params(self, params: Any, version: int | None = None) -> None:
    """Swap in new weights (same shapes: no recompilation); bump the
    policy version (or set it)."""
    self.params = self.load_params(params)
    self.policy_version = (
      self.policy_version + 1 if version is None else version
    )

  def compile_count(self) -> int:
    """Compiled variants of the engine's jitted functions so far."""
    return sum(
      f._cache_size()
      for f in (
        self._prefill_jit,
        self._insert_jit,
        self._generate_jit,
        self._chunk_jit,
        self._compact_jit,
        self._refill_jit,
      )
    )

  def _replicate(self, *xs):
    """Inputs made on the default device, replicated over the engine mesh
    (jit refuses arguments committed to different device sets)."""
    if self._mesh is None:
      return xs
    rep = jax.sharding.NamedSharding(self._mesh, jax.sharding.PartitionSpec())
    return jax.device_put(xs, rep)
