"""`PolicyEngine`: the jaxcorr `Transformer` behind JetStream's `Engine` API,
with the contract's per-token log-probs (`docs/math/rollout_contract.md`).

    prefill(prompt padded to a bucket) -> Prefix (KV cache [L,1,Pb,K,Dh],
                                                  first token + log-probs)
    insert(prefix, state, slot)        -> the slot's cache row, sampling
                                          params and RNG key replaced
    generate(params, state)            -> one token for every slot: forward,
                                          sample (`jaxcorr.sampling`),
                                          log-probs, cache write

Per-slot positions: the decode state holds one single-row `KVCache` per
slot (leading slot axis) and the model's own cached forward is `vmap`ped
over slots, so each slot keeps its own write index (= its position) while
the transformer math stays in `jaxcorr.model`. Prompts are right-padded
inside their bucket; after prefill the padding slots are marked empty and
the write index set to the true length, so decoding overwrites them.

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
import numpy as np
from flax import nnx
from jetstream.engine import engine_api, tokenizer_pb2

from jaxcorr import sampling
from jaxcorr.model import KVCache, Transformer
from jaxcorr.rollout.state import (
  DecodeState,
  LogProbResultTokens,
  Prefix,
  SamplingParams,
  pack_sampling,
)
from jaxcorr.rollout.tokenizer import IdTokenizer
from jaxcorr.sharding import param_shardings

_MIN_BUCKET = 16

__all__ = [
  'DecodeState',
  'LogProbResultTokens',
  'PolicyEngine',
  'Prefix',
  'SamplingParams',
]


class PolicyEngine(engine_api.Engine):
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
  ):
    if max_prefill_length > max_target_length:
      raise ValueError(
        f'max_prefill_length={max_prefill_length} exceeds '
        f'max_target_length={max_target_length}'
      )
    cfg = model.config
    if dtype is not None:
      cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    self.config = cfg
    self._n = max_concurrent_decodes
    self._max_prefill = max_prefill_length
    self._max_target = max_target_length
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
    b, self.buckets = _MIN_BUCKET, []
    while b < max_prefill_length:
      self.buckets.append(b)
      b *= 2
    self.buckets.append(max_prefill_length)
    self._prefill_jit = jax.jit(self._prefill_fn)
    self._insert_jit = jax.jit(self._insert_fn, donate_argnums=(1,))
    self._generate_jit = jax.jit(self._generate_fn, donate_argnums=(1,))
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
    """Compiled variants of prefill/insert/generate so far."""
    return sum(
      f._cache_size()
      for f in (self._prefill_jit, self._insert_jit, self._generate_jit)
    )

  # ------------------------------------------------------------- prefill

  def bucket(self, length: int) -> int:
    """The padded prefill length for a prompt of `length` tokens."""
    if not 0 < length <= self._max_prefill:
      raise ValueError(
        f'prompt length {length} must be in [1, max_prefill_length='
        f'{self._max_prefill}]'
      )
    return next(b for b in self.buckets if b >= length)

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
        jnp.asarray(true_length, jnp.int32),
        jnp.asarray(key, jnp.uint32),
        pack_sampling(sp),
      ),
    )

  def _replicate(self, *xs):
    """Inputs made on the default device, replicated over the engine mesh
    (jit refuses arguments committed to different device sets)."""
    if self._mesh is None:
      return xs
    rep = jax.sharding.NamedSharding(self._mesh, jax.sharding.PartitionSpec())
    return jax.device_put(xs, rep)

  def _prefill_fn(self, params, tokens, true_length, key, sp):
    model = nnx.merge(self._graphdef, params)
    pb = tokens.shape[1]
    cache = model.init_cache(1, pb)
    hidden, cache = model.hidden_states(tokens, cache=cache)
    # Right padding: the padding slots become empty and the next write
    # (the first decoded token) goes to the true length.
    filled = jnp.arange(pb, dtype=jnp.int32)[None] < true_length
    cache = cache.replace(
      segment_ids=filled.astype(jnp.int32), index=true_length
    )
    last = jax.lax.dynamic_index_in_dim(hidden, true_length - 1, axis=1)
    logits = model.logits(last)[:, 0]
    tok, lp, lpt = _sample(jax.random.fold_in(key, 0)[None], logits, sp[None])
    return Prefix(cache, tok[0], lp[0], lpt[0], key, sp)

  # -------------------------------------------------------------- insert

  def init_decode_state(self, *args, **kwargs) -> DecodeState:
    """Empty slots: zero caches of max_target_length tokens each."""
    del args, kwargs
    n = self._n
    shape = (n, self.config.num_layers, 1, self._max_target)
    shape += (self.config.num_kv_heads, self.config.head_dim)
    cache = KVCache(
      k=jnp.zeros(shape, self.config.dtype),
      v=jnp.zeros(shape, self.config.dtype),
      segment_ids=jnp.zeros((n, 1, self._max_target), jnp.int32),
      index=jnp.zeros((n,), jnp.int32),
    )
    state = DecodeState(
      cache=cache,
      tokens=jnp.zeros((n,), jnp.int32),
      steps=jnp.zeros((n,), jnp.int32),
      keys=jnp.zeros((n, 2), jnp.uint32),
      sampling=jnp.tile(pack_sampling(SamplingParams()), (n, 1)),
    )
    return self._replicate(state)[0]

  def insert(
    self, prefix: Prefix, decode_state: DecodeState, slot: int
  ) -> DecodeState:
    """Place `prefix` in `slot` (a traced index: one compile per bucket)."""
    if not 0 <= slot < self._n:
      raise ValueError(f'slot {slot} not in [0, {self._n})')
    return self._insert_jit(prefix, decode_state, jnp.asarray(slot, jnp.int32))

  def _insert_fn(self, prefix, state, slot):
    pad = self._max_target - prefix.cache.k.shape[2]
    kv_pad = ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0))
    row = KVCache(
      k=jnp.pad(prefix.cache.k, kv_pad).astype(state.cache.k.dtype),
      v=jnp.pad(prefix.cache.v, kv_pad).astype(state.cache.v.dtype),
      segment_ids=jnp.pad(prefix.cache.segment_ids, ((0, 0), (0, pad))),
      index=prefix.cache.index,
    )
    put = functools.partial(
      jax.lax.dynamic_update_index_in_dim, index=slot, axis=0
    )
    return DecodeState(
      cache=jax.tree.map(lambda s, r: put(s, r), state.cache, row),
      tokens=put(state.tokens, prefix.token),
      steps=put(state.steps, jnp.ones((), jnp.int32)),
      keys=put(state.keys, prefix.key),
      sampling=put(state.sampling, prefix.sampling),
    )

  # ------------------------------------------------------------ generate

  def generate(
    self, params: nnx.State, decode_state: DecodeState
  ) -> tuple[DecodeState, LogProbResultTokens]:
    """One token for every slot (empty slots compute garbage, ignored)."""
    return self._generate_jit(params, decode_state)

  def _generate_fn(self, params, state):
    model = nnx.merge(self._graphdef, params)

    def one_slot(token, cache):
      # The model's cached forward on a one-row cache: positions and the
      # write slot come from this slot's own index.
      return model.hidden_states(token.reshape(1, 1), cache=cache)

    hidden, cache = jax.vmap(one_slot)(state.tokens, state.cache)
    logits = model.logits(hidden[:, 0])[:, 0]  # [N, V] float32
    keys = jax.vmap(jax.random.fold_in)(state.keys, state.steps)
    tok, lp, lpt = _sample(keys, logits, state.sampling)
    steps = state.steps + 1
    state = DecodeState(cache, tok, steps, state.keys, state.sampling)
    n = tok.shape[0]
    bits = jax.lax.bitcast_convert_type(jnp.stack([lp, lpt], 1), jnp.int32)
    data = jnp.concatenate(
      [tok[:, None], jnp.ones((n, 1), jnp.int32), steps[:, None], bits], 1
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


def _sample(keys, logits, sp):
  """keys [N, 2], logits [N, V], sp [N, 4] -> token, logp, logp_trunc [N]."""
  return sampling.sample(
    keys, logits, sp[:, 0], sp[:, 1].astype(jnp.int32), sp[:, 2], sp[:, 3]
  )
