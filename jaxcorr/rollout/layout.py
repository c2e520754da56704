"""`Layout`: the sizes every part of `PolicyEngine` agrees on
(jaxcorr/rollout/engine.py), fixed when the engine is built.

    config            the model config at the engine's dtype
    slots             N decode slots; max_target_length T cache positions each
    prefill buckets   prompts pad to 16, 32, ... up to max_prefill_length
    attend buckets    decode attends over min_attend_bucket, 2x, ... up to T
                      (exact mode: always all T, jaxcorr/model/exact.py)
    chunk_steps       most decode steps per `decode_chunk` dispatch
    kept_capacity     C of the recorded kept sets (0: none)
    mesh              where the engine's inputs are replicated

Buckets keep the number of compiled shapes logarithmic in the lengths.
Nothing here changes after construction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcorr.model import TransformerConfig
from jaxcorr.rollout import decode
from jaxcorr.rollout.state import DecodeState, SamplingParams, pack_sampling

_MIN_BUCKET = 16


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
  """lo, 2 lo, 4 lo, ... below hi, then hi (a logarithmic number)."""
  out, b = [], lo
  while b < hi:
    out.append(b)
    b *= 2
  return (*out, hi)


def bucket_of(buckets: Sequence[int], n: int) -> int:
  """The smallest bucket >= n."""
  return next(b for b in buckets if b >= n)


def stop_array(stop_ids: Sequence[int]) -> jax.Array:
  """Stop token ids padded with -1 to a power of two (>= 4): few shapes,
  few compilations."""
  ids = sorted(set(int(t) for t in stop_ids))
  size = bucket_of(pow2_buckets(4, max(4, len(ids))), max(1, len(ids)))
  out = np.full((size,), -1, np.int32)
  out[: len(ids)] = ids
  return jnp.asarray(out)


@dataclasses.dataclass(frozen=True)
class Layout:
  """The engine's fixed sizes (module docstring); `PolicyEngine`'s
  arguments of the same names, checked here."""

  config: TransformerConfig
  slots: int
  max_prefill: int
  max_target: int
  chunk_steps: int
  min_attend_bucket: int
  kept_capacity: int
  mesh: jax.sharding.Mesh | None
  # The KV cache's storage dtype (None: the model's; int8 / fp8: narrow
  # values with per-token scales, jaxcorr/model/quantized_cache.py).
  kv_dtype: Any = None
  # Exact mode (`rollout.exact`): batch-invariant prefill and decode.
  exact: bool = False

  def __post_init__(self):
    kv = self.kv_dtype
    if self.exact and kv is not None and kv != self.config.dtype:
      raise ValueError(
        f'exact=True with kv_cache_dtype={jnp.dtype(kv).name}: exact mode '
        "needs the cache in the engine dtype (kv_cache_dtype='model')"
      )
    if self.kv_dtype is not None:
      kv, model = jnp.dtype(self.kv_dtype), jnp.dtype(self.config.dtype)
      if kv.itemsize > model.itemsize:
        raise ValueError(
          f'kv_cache_dtype={kv.name} is wider than the engine dtype '
          f'{model.name}; allowed: the model dtype or a narrower one '
          '(int8, fp8)'
        )
    if self.max_prefill > self.max_target:
      raise ValueError(
        f'max_prefill_length={self.max_prefill} exceeds '
        f'max_target_length={self.max_target}'
      )
    vocab = self.config.vocab_size
    if not 0 <= self.kept_capacity <= vocab:
      raise ValueError(
        f'kept_set_capacity={self.kept_capacity}; allowed: 0 (off) or an '
        f'int in [1, vocab_size={vocab}]'
      )
    if self.chunk_steps < 1 or self.min_attend_bucket < 1:
      raise ValueError(
        f'decode_chunk={self.chunk_steps} and min_attend_bucket='
        f'{self.min_attend_bucket} must be >= 1'
      )

  @property
  def prefill_buckets(self) -> tuple[int, ...]:
    """Padded prompt lengths: one prefill compilation each."""
    return pow2_buckets(_MIN_BUCKET, self.max_prefill)

  @property
  def attend_buckets(self) -> tuple[int, ...]:
    """Attention windows of a decode step: one compilation each."""
    if self.exact:  # every step attends over the whole cache
      return (self.max_target,)
    lo = min(self.min_attend_bucket, self.max_target)
    return pow2_buckets(lo, self.max_target)

  def bucket(self, length: int) -> int:
    """The padded prefill length for a prompt of `length` tokens."""
    if not 0 < length <= self.max_prefill:
      raise ValueError(
        f'prompt length {length} must be in [1, max_prefill_length='
        f'{self.max_prefill}]'
      )
    return bucket_of(self.prefill_buckets, length)

  def attend_bucket(self, longest: int) -> int:
    """The attention bucket covering cache slots [0, longest)."""
    if not 0 < longest <= self.max_target:
      raise ValueError(
        f'length {longest} not in [1, max_target_length={self.max_target}]'
      )
    return bucket_of(self.attend_buckets, longest)

  def replicate(self, *xs: Any) -> tuple[Any, ...]:
    """Inputs made on the default device, replicated over the engine mesh
    (jit refuses arguments committed to different device sets)."""
    if self.mesh is None:
      return xs
    rep = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    return jax.device_put(xs, rep)

  def empty_state(self) -> DecodeState:
    """N empty slots: zero caches of max_target_length tokens each."""
    state = decode.init_state(
      self.config,
      self.slots,
      self.max_target,
      pack_sampling(SamplingParams()),
      self.kv_dtype,
    )
    return self.replicate(state)[0]

  @property
  def exact_extent(self) -> int:
    """The key extent of exact mode's attention (the cache length), or 0
    when exact mode is off."""
    return self.max_target if self.exact else 0
