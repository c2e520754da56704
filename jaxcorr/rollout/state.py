"""The engine's data: per-request sampling settings, a prefilled request
(`Prefix`), the decode state over slots, and the JetStream result type that
also carries log-probs."""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxcorr.model import KVCache
from jaxcorr.rollout.kept_set import KeptSet
from jaxcorr.rollout.tf_startup import quiet_tensorflow_startup

with quiet_tensorflow_startup():  # JetStream's engine_api imports TensorFlow
  from jetstream.engine import engine_api


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-request sampling settings (off = 0, 1.0, 0.0; greedy: top_k=1)."""

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0

  def __post_init__(self):
    if not self.temperature > 0:
      raise ValueError(f'temperature must be > 0, got {self.temperature}')
    if self.top_k < 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p <= 1:
      raise ValueError(f'invalid truncation settings: {self}')


@flax.struct.dataclass
class Prefix:
  """Prefilled prompts and the first token of each request drawn from them.

  R prompts share one padded length Pb; M requests each point at their
  prompt (`source`), so the G samples of a prompt share one prefill. The
  JetStream `prefill` makes R = M = 1.

  cache: KVCache, k/v L x [R, K, Pb, Dh], segment_ids None, index [R] the
  true prompt lengths; the request arrays below are [M].
  """

  cache: KVCache
  source: jax.Array  # int32 [M]: prompt row of each request
  token: jax.Array  # int32 [M]: first sampled token
  logp: jax.Array  # float32 [M]
  logp_truncated: jax.Array  # float32 [M]
  key: jax.Array  # uint32 [M, 2]
  sampling: jax.Array  # float32 [M, 4]: temperature, top_k, top_p, min_p
  # KeptSet of [M] tokens (rollout/kept_set.py), only with a kept-set
  # capacity (logprob_mode='replay').
  kept: KeptSet | None = None
  # MoE policies: the experts of every prompt position (docs/moe.md).
  routing: jax.Array | None = None  # int32 [M, Pb, L_moe, k]
  # The padded prompts [R, Pb] (batched path): the speculative n-gram
  # draft's context (jaxcorr/rollout/speculative.py); None elsewhere.
  prompt: jax.Array | None = None


@flax.struct.dataclass
class DecodeState:
  """Every slot's state; N = max_concurrent_decodes.

  cache: KVCache, k/v L x [N, K, T, Dh] (one array per layer, updated in
  place), segment_ids None, index [N] = each slot's next position; tokens
  [N] the last sampled token (the next step's input); steps [N] tokens
  sampled so far; keys [N, 2]; sampling [N, 4] as in `Prefix`; limit [N]
  the most tokens a request may have; active [N] False once a slot's
  request met a stop token or its limit (and for empty slots): the
  multi-step decode neither advances nor reports it.
  """

  cache: KVCache
  tokens: jax.Array
  steps: jax.Array
  keys: jax.Array
  sampling: jax.Array
  limit: jax.Array
  active: jax.Array
  # Speculative decoding only: int32 [N, T] each slot's tokens by position
  # (the n-gram draft's context); None otherwise.
  history: jax.Array | None = None
  # Speculative draft='model' only: the draft model's KVCache, its layers
  # x [N, K_d, T, Dh_d] (jaxcorr/rollout/draft_model.py); None otherwise.
  draft: KVCache | None = None


@flax.struct.dataclass
class Chunk:
  """What one multi-step decode dispatch hands back to the host; C =
  decode_chunk. Slot n produced `counts[n]` tokens, in columns [0,
  counts[n]) (a slot stops producing once inactive, and never resumes
  inside a chunk)."""

  tokens: jax.Array  # int32 [N, C]
  logp: jax.Array  # float32 [N, C]
  logp_truncated: jax.Array  # float32 [N, C]
  counts: jax.Array  # int32 [N]
  active: jax.Array  # bool [N], after the chunk
  steps: jax.Array  # int32 []: decode steps run
  kept: KeptSet | None = None  # [N, C] tokens' kept sets (replay only)
  # MoE policies: the experts of the token each step fed (the one sampled
  # the step before), -1 past a slot's count (docs/moe.md).
  routing: jax.Array | None = None  # int32 [N, C, L_moe, k]


@flax.struct.dataclass
class LogProbResultTokens(engine_api.ResultTokens):
  """`ResultTokens` whose data also holds float32 log-probs (bitcast)."""

  logp_idx: tuple[int, int] = flax.struct.field(
    pytree_node=False, default=(3, 5)
  )

  def convert_to_numpy(self) -> LogProbResultTokens:
    return self.replace(data=np.asarray(self.data))

  def logprobs(self) -> tuple[np.ndarray, np.ndarray]:
    """(logp_full [N], logp_truncated [N]) float32 on the host."""
    raw = np.asarray(self.data[:, self.logp_idx[0] : self.logp_idx[1]])
    f = raw.astype(np.int32).view(np.float32)
    return f[:, 0], f[:, 1]


def pack_sampling(sp: SamplingParams) -> jax.Array:
  """[4] float32: temperature, top_k, top_p, min_p (a jit argument, so
  changing the settings never recompiles)."""
  return jnp.asarray(
    [sp.temperature, sp.top_k, sp.top_p, sp.min_p], jnp.float32
  )
