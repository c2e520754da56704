"""Shared helpers for the rollout tests: kept-set conversions the engine and
trainer never need (a dense membership mask, slime's ragged layout) and the
engine's compile count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcorr.rollout.kept_set import PAD_ID, KeptSet


def kept_mask(kept: KeptSet, vocab_size: int) -> jax.Array:
  """`[..., V]` bool membership of a `KeptSet` (small V only).

  Ids outside [0, V) and entries past `count` are ignored.
  """
  c = kept.ids.shape[-1]
  live = jnp.arange(c) < kept.count[..., None]
  live &= (kept.ids >= 0) & (kept.ids < vocab_size)
  hot = jax.nn.one_hot(jnp.where(live, kept.ids, vocab_size), vocab_size + 1)
  return jnp.any(hot[..., :vocab_size] > 0, axis=-2)


def from_ragged(
  ids: np.ndarray,
  offsets: np.ndarray,
  length: int,
  capacity: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Host-side: a ragged list of kept sets → `(ids [L, C], count, capped)`.

  Token r's set is `ids[offsets[r]:offsets[r + 1]]` (slime's and vLLM's
  ragged layout, engine order); `offsets` has `length + 1` entries from 0
  to `len(ids)`. Sets wider than C keep their first C ids (the most
  probable) and are flagged capped. Malformed input raises ValueError
  naming the rule (no silent repair: see `rollout/validate.py`).
  """
  ids = np.asarray(ids, np.int64)
  offsets = np.asarray(offsets, np.int64)
  if offsets.shape != (length + 1,):
    raise ValueError(
      f'kept-set offsets: {offsets.shape[0]} entries for {length} tokens; '
      f'allowed: exactly length + 1 = {length + 1}'
    )
  if offsets[0] != 0 or offsets[-1] != ids.size or np.any(np.diff(offsets) < 0):
    raise ValueError(
      'kept-set offsets must start at 0, be non-decreasing and end at '
      f'len(ids)={ids.size}; got {offsets[:3].tolist()}...{offsets[-1]}'
    )
  out = np.full((length, capacity), PAD_ID, np.int32)
  size = np.diff(offsets)
  for r in range(length):
    row = ids[offsets[r] : offsets[r + 1]][:capacity]
    out[r, : row.size] = row
  return out, np.minimum(size, capacity).astype(np.int32), size > capacity


def compile_count(engine) -> int:
  """Compiled variants of a `PolicyEngine`'s jitted functions so far."""
  programs = engine.programs._replace(graphdef=None)
  return sum(f._cache_size() for f in programs if f is not None)
