"""The engine's data: per-request sampling settings, a prefilled request
(`Prefix`), the decode state over slots, and the JetStream result type that
also carries log-probs."""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jetstream.engine import engine_api

from jaxcorr.model import KVCache


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
  """A prefilled request: cache [L, 1, Pb, K, Dh], its first sampled token
  and that token's log-probs (scalars), its RNG key and sampling params."""

  cache: KVCache
  token: jax.Array
  logp: jax.Array
  logp_truncated: jax.Array
  key: jax.Array  # uint32 [2]
  sampling: jax.Array  # float32 [4]: temperature, top_k, top_p, min_p


@flax.struct.dataclass
class DecodeState:
  """Every slot's state; N = max_concurrent_decodes.

  cache: KVCache with a leading slot axis (k/v [N, L, 1, T, K, Dh],
  segment_ids [N, 1, T], index [N] = each slot's next position);
  tokens [N] the last sampled token (the next step's input); steps [N]
  tokens sampled so far; keys [N, 2]; sampling [N, 4] as in `Prefix`.
  """

  cache: KVCache
  tokens: jax.Array
  steps: jax.Array
  keys: jax.Array
  sampling: jax.Array


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
