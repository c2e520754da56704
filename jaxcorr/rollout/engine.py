"""`PolicyEngine`: the jaxcorr `Transformer` behind JetStream's `Engine` API,
with the contract's per-token log-probs (`docs/math/rollout_contract.md`).

The engine is composed of four parts, each in its own module with its own
state; this class builds them and gives JetStream and the decoder one object:

    layout     jaxcorr/rollout/layout.py: the fixed sizes (slots, cache
               length, prefill and attention buckets, chunk length, kept-set
               width, mesh) and the empty decode state
    programs   jaxcorr/rollout/decode.py: the jitted device functions
    weights    jaxcorr/rollout/policy_weights.py: the current params and
               their policy version
    requests   jaxcorr/rollout/requests.py: JetStream's one-request API
               (prefill, insert, generate) and its tokenizer
    batched    jaxcorr/rollout/batched.py: the batched, device-resident path
               `rollout.decoder.Decoder` drives (prefill_batch, insert_batch,
               decode_chunk, compact, refresh_cache)

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

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from jaxcorr.model import Transformer, TransformerConfig
from jaxcorr.model.lora import LoraConfig
from jaxcorr.model.quantized_weights import QuantSpec
from jaxcorr.rollout import decode, layout, precision
from jaxcorr.rollout import speculative as speculative_lib
from jaxcorr.rollout.adapter_weights import AdapterWeights
from jaxcorr.rollout.batched import BatchedDecoding
from jaxcorr.rollout.draft_model import DraftModel
from jaxcorr.rollout.policy_weights import PolicyWeights
from jaxcorr.rollout.requests import RequestDecoding
from jaxcorr.rollout.state import (
  Chunk,
  DecodeState,
  LogProbResultTokens,
  Prefix,
  SamplingParams,
)
from jaxcorr.rollout.tf_startup import quiet_tensorflow_startup
from jaxcorr.rollout.tokenizer import IdTokenizer

with quiet_tensorflow_startup():  # JetStream's engine_api imports TensorFlow
  from jetstream.engine import engine_api, tokenizer_pb2

__all__ = ['PolicyEngine']


class PolicyEngine(engine_api.Engine):
  """JetStream engine over a jaxcorr `Transformer` (see module docstring).

  Args:
    model: the policy; its params become version 0.
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
    lora: a LoRA policy's adapter config: weights then swap by adapter
      (`rollout/adapter_weights.py`, merged or not as it says).
    quantization, kv_cache_dtype: narrow weights (a `QuantSpec`) and KV
      cache ('int8', 'fp8'); None: `dtype` (`rollout/precision.py`).
    exact: exact mode (`jaxcorr.model.exact`): each token's log-prob does
      not depend on the batch, the slot or prefill vs decode, and equals the
      trainer's exact scoring bit for bit; not with quantization.
    speculative: a `SpeculativeConfig` (draft, k): the decode chunk runs
      exact speculative sampling (`rollout/speculative.py`); None: off.
    draft: the `DraftModel` of speculative draft='model' (its own KV
      cache; not changed by `update_params`).
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
    lora: LoraConfig | None = None,
    quantization: QuantSpec | None = None,
    kv_cache_dtype: str | None = None,
    exact: bool = False,
    speculative: speculative_lib.SpeculativeConfig | None = None,
    draft: DraftModel | None = None,
  ):
    if exact and quantization is not None:
      raise ValueError(
        'exact=True needs unquantized engine weights (quantization=None): '
        "narrow weights cannot give the trainer's log-probs"
      )
    cfg = model.config
    if dtype is not None:
      cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    spec = speculative if speculative and speculative.enabled else None
    if spec is not None:
      spec.check(
        cfg,
        exact=exact,
        kept_capacity=kept_set_capacity,
        moe=bool(cfg.moe_layers),
        draft_cfg=None if draft is None else draft.config,
      )
    make_layout = (
      layout.Layout if spec is None else speculative_layout(spec, draft)
    )
    self.layout = make_layout(
      config=cfg,
      slots=max_concurrent_decodes,
      max_prefill=max_prefill_length,
      max_target=max_target_length,
      chunk_steps=decode_chunk,
      min_attend_bucket=min_attend_bucket,
      kept_capacity=kept_set_capacity,
      mesh=mesh,
      kv_dtype=precision.kv_storage_dtype(kv_cache_dtype),
      exact=exact,
    )
    graphdef, self.weights = _weights(cfg, model, mesh, lora, quantization)
    self.programs = decode.jit_programs(
      graphdef, kept_set_capacity, self.layout.exact_extent
    )
    if spec is not None:
      self.programs = speculative_lib.with_speculation(
        self.programs, self.layout, draft
      )
    self.requests = RequestDecoding(
      self.layout,
      self.programs,
      tokenizer=tokenizer or IdTokenizer(cfg.vocab_size),
      default_sampling=default_sampling or SamplingParams(),
      seed=seed,
    )
    self.batched = BatchedDecoding(self.layout, self.programs, self.weights)

  # ------------------------------------------------ sizes and weights

  @property
  def config(self) -> TransformerConfig:
    """The model config at the engine's dtype."""
    return self.layout.config

  @property
  def kept_set_capacity(self) -> int:
    return self.layout.kept_capacity

  @property
  def params(self) -> nnx.State:
    """The current weights (`PolicyWeights.params`)."""
    return self.weights.params

  @property
  def policy_version(self) -> int:
    return self.weights.version

  def update_params(self, params: Any, version: int | None = None) -> None:
    """Swap in new weights (same shapes: no recompilation); bump the
    policy version (or set it)."""
    self.weights.update(params, version)

  @staticmethod
  def stop_array(stop_ids: Sequence[int]) -> jax.Array:
    """Stop token ids padded to few shapes (`layout.stop_array`)."""
    return layout.stop_array(stop_ids)

  # ----------------------------------------------- JetStream's API

  def load_params(self, params: Any = None, *args, **kwargs) -> nnx.State:
    """Trainer params (a `Transformer` or its `nnx.State`) cast to the
    engine dtype and placed on the engine mesh; no argument: the engine's
    current params (what JetStream's server asks for)."""
    del args, kwargs
    return self.params if params is None else self.weights.load(params)

  def init_decode_state(self, *args, **kwargs) -> DecodeState:
    """Empty slots: zero caches of max_target_length tokens each."""
    del args, kwargs
    return self.layout.empty_state()

  def pad_prompt(self, prompt: Any) -> tuple[jax.Array, int]:
    """Token ids -> (right-padded [bucket] int32, true length)."""
    return self.requests.pad_prompt(prompt)

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
    """KV cache and first token of one prompt (`padded_tokens` [Pb]); a
    request without a key gets the next one of the engine's seed."""
    return self.requests.prefill(
      params=params,
      existing_prefix=existing_prefix,
      padded_tokens=padded_tokens,
      true_length=true_length,
      sampling_params=sampling_params,
      key=key,
    )

  def insert(
    self, prefix: Prefix, decode_state: DecodeState, slot: int
  ) -> DecodeState:
    """Place `prefix` in `slot`."""
    return self.requests.insert(prefix, decode_state, slot)

  def generate(
    self, params: nnx.State, decode_state: DecodeState
  ) -> tuple[DecodeState, LogProbResultTokens]:
    """One token for every slot (empty slots compute garbage, ignored)."""
    return self.requests.generate(params, decode_state)

  def get_prefix_destination_sharding(self) -> Any:
    return None  # prefill and generate share the engine's devices

  def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
    return tokenizer_pb2.TokenizerParameters(path='jaxcorr-ids')

  def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters):
    del metadata
    return self.requests.tokenizer

  @property
  def max_concurrent_decodes(self) -> int:
    return self.layout.slots

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self.layout.max_prefill

  @property
  def max_target_length(self) -> int:
    return self.layout.max_target

  @property
  def mesh(self) -> jax.sharding.Mesh | None:
    return self.layout.mesh

  @property
  def colocated_cpus(self) -> None:
    return None

  # ------------------------------------- the batched path (Decoder's)

  def prefill_batch(
    self,
    params: nnx.State,
    prompts: Sequence[Sequence[int]],
    source: Sequence[int],
    keys: jax.Array,
    sampling_params: SamplingParams,
  ) -> Prefix:
    """One forward over `prompts`, a first token per request (request m
    from prompt `source[m]` with `keys[m]`)."""
    return self.batched.prefill_batch(
      params, prompts, source, keys, sampling_params
    )

  def insert_batch(
    self,
    prefix: Prefix,
    decode_state: DecodeState,
    slots: Sequence[int],
    limits: Sequence[int],
    stop_ids: jax.Array,
  ) -> DecodeState:
    """Requests of a `prefill_batch` prefix into `slots`, with their
    token budgets `limits`."""
    return self.batched.insert_batch(
      prefix, decode_state, slots, limits, stop_ids
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
    """Up to `decode_chunk` steps of every active slot in one dispatch
    (`BatchedDecoding.decode_chunk`)."""
    return self.batched.decode_chunk(
      decode_state,
      stop_ids,
      exit_active=exit_active,
      attend_len=attend_len,
      params=params,
    )

  def compact(
    self, decode_state: DecodeState, rows: Sequence[int]
  ) -> DecodeState:
    """`BatchedDecoding.compact`: the state of slots `rows`."""
    return self.batched.compact(decode_state, rows)

  def refresh_cache(
    self, decode_state: DecodeState, contexts: Sequence[Sequence[int] | None]
  ) -> DecodeState:
    """`BatchedDecoding.refresh_cache`: live rows' caches recomputed under
    the current weights."""
    return self.batched.refresh_cache(decode_state, contexts)


def speculative_layout(spec, draft):
  """A `Layout` constructor whose states suit `spec`'s decode chunk (and
  hold `draft`'s cache)."""
  draft_cfg = None if draft is None else draft.config
  return lambda **kw: speculative_lib.SpeculativeLayout(
    **kw, speculative=spec, draft_config=draft_cfg
  )


def _weights(cfg, model, mesh, lora, quantization) -> tuple[Any, Any]:
  """(the engine model's graph, its weights): `PolicyWeights` of a plain
  `Transformer` (narrow when `quantization` says so), or for a LoRA policy
  `AdapterWeights` over the plain graph (merged) or the LoRA graph
  (unmerged)."""
  lora = lora if lora is not None and lora.enabled else None
  if lora is not None:
    if quantization is not None:
      raise ValueError(
        'a LoRA engine with quantized weights is not supported: '
        "config.rollout.quantization must be 'none' with config.lora.rank > 0"
      )
    weights = AdapterWeights(config=cfg, lora=lora, mesh=mesh, initial=model)
    return weights.delivery.graphdef, weights
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract)
  weights = PolicyWeights(
    abstract_state,
    param_dtype=cfg.param_dtype,
    mesh=mesh,
    initial=model,
    quantize=precision.quantizer(graphdef, quantization),
  )
  return graphdef, weights
