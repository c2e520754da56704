"""Sampling-mask replay: the kept set K_t in a fixed-width, device-friendly form.

`rollout.logprob_mode='replay'` (DeepSeek-V3.2 "keep sampling mask", slime
#2102): the engine records, per generated token, the set K_t of token ids it
sampled from (top-k ∩ top-p ∩ min-p, `jaxcorr.sampling.support`), and the
trainer renormalises its own log-probs over exactly that set
(`jaxcorr.model.logprobs.replay_logprobs`). The two distributions then live
on the same support, so with identical weights the ratio is exactly 1 even
under heavy truncation, and membership carries no gradient.

Format (`KeptSet`), per token, width C = `capacity` fixed at trace time:

* `ids`   int32 `[..., C]`: the kept ids in engine order (descending
  probability), `-1` past `count`;
* `count` int32 `[...]`: `min(|K_t|, C)`;
* `capped` bool `[...]`: `|K_t| > C`.

A set wider than C keeps its C most probable ids and is flagged `capped`.
The engine reports the log-prob of the sampled token renormalised over the
*stored* set ∪ {y} (`replay_logprobs` on its own logits), and the trainer
renormalises over the same stored set, so the ratio stays consistent; what
changes is that the tail of K_t beyond the C most probable ids (at most the
mass outside them) is treated like the rest of the truncated vocabulary.
`replay_metrics` counts capped tokens (`replay/capped_fraction`), and
`rollout/validate.py` bounds it. Memory: C int32 per token (C = 64: 256
bytes) instead of a V-wide bitmask (V/8 bytes: 19 KB at V = 152k).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxcorr import sampling
from jaxcorr.losses import masked

PAD_ID = -1


@flax.struct.dataclass
class KeptSet:
  """The kept sets of a batch of tokens (see the module docstring)."""

  ids: jax.Array  # [..., C] int32, engine order, PAD_ID past count
  count: jax.Array  # [...] int32, min(|K|, C)
  capped: jax.Array  # [...] bool, |K| > C


def kept_set(
  logits: jax.Array,
  *,
  capacity: int,
  temperature: float | jax.Array = 1.0,
  top_k: int | jax.Array = 0,
  top_p: float | jax.Array = 1.0,
  min_p: float | jax.Array = 0.0,
) -> KeptSet:
  """The engine's kept set K_t from its logits, as a `KeptSet` of width C.

  `K = sampling.support(logits, τ, top_k, top_p, min_p)` (the rule the
  sampler draws from); its C most probable ids in descending probability
  (ties to the lower id), `count = min(|K|, C)`, `capped = |K| > C`.

  Args:
    logits: `[..., V]` raw engine logits of the step.
    capacity: C, static, 1 ≤ C ≤ V.
    temperature, top_k, top_p, min_p: scalars or `[...]` (see `support`).
  """
  v = logits.shape[-1]
  if not isinstance(capacity, int) or not 1 <= capacity <= v:
    raise ValueError(
      f'capacity={capacity!r} is invalid; allowed: an int in [1, V={v}]'
    )
  keep = sampling.support(logits, temperature, top_k, top_p, min_p)
  z = sampling.scaled_logits(logits, temperature)
  # Stable order: equal logits rank by id, as in `support`.
  _, ids = jax.lax.top_k(jnp.where(keep, z, -jnp.inf), capacity)
  size = jnp.sum(keep, axis=-1, dtype=jnp.int32)
  count = jnp.minimum(size, capacity)
  live = jnp.arange(capacity, dtype=jnp.int32) < count[..., None]
  return KeptSet(
    ids=jnp.where(live, ids.astype(jnp.int32), PAD_ID),
    count=count,
    capped=size > capacity,
  )


def replay_metrics(
  log_kept_mass: jax.Array, kept: KeptSet, mask: jax.Array
) -> dict[str, jax.Array]:
  """Diagnostics of replay over the valid tokens (0 on an empty mask).

  Args:
    log_kept_mass: `[B, T]` `log Z_t`, the trainer's log-mass on K_t ∪ {y}
      (from `replay_logprobs`).
    kept: the `KeptSet` of `[B, T]` tokens.
    mask: bool `[B, T]`.

  Returns:
    `replay/kept_mass_mean` (mean Z_t), `replay/kept_mass_min`,
    `replay/set_size_mean`, `replay/set_size_max` and
    `replay/capped_fraction`. Means are over tokens: to combine
    micro-batches, weight them by their token counts; min/max reduce with
    min/max.
  """
  z = jnp.exp(jnp.where(mask, log_kept_mass, 0.0))
  size = kept.count.astype(jnp.float32)
  return {
    'replay/kept_mass_mean': masked.masked_mean(z, mask),
    'replay/kept_mass_min': masked.masked_min(z, mask),
    'replay/set_size_mean': masked.masked_mean(size, mask),
    'replay/set_size_max': masked.masked_max(size, mask),
    'replay/capped_fraction': masked.masked_mean(
      kept.capped.astype(jnp.float32), mask
    ),
  }
