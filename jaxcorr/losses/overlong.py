"""Overlong shaping (DAPO, arXiv 2503.14476, section 3.4; docs/algorithms.md,
"Overlong shaping"): the truncation filter and the soft overlong penalty.

A row is *truncated* when its `RolloutBatch.finish_reason` is LENGTH: the
engine ran out of `rollout.max_new_tokens` before an end token, or (multi-
turn, jaxcorr/agents/trajectory.py) the trajectory hit the token budget,
`agent.max_turns` or an over-long observation before its answer.

* `mask_truncated`: TRL's `mask_truncated_completions`. A truncated row
  carries no loss; it stays a member of its group, so its reward still
  enters the group's baseline (TRL computes rewards and advantages over
  every completion and zeroes only the completion mask).
* `overlong_penalty`: verl's DAPO reward manager
  (`reward_model.overlong_buffer.{enable,len,penalty_factor}`,
  verl/workers/reward_manager/dapo.py), for a response of L tokens, a
  budget L_max and a buffer (DAPO's "cache") L_buf:

      penalty(L) = min(−(L − (L_max − L_buf)) / L_buf · factor, 0)

  0 up to L_max − L_buf, then a linear ramp to −factor at L = L_max.
  L counts every response-side token, environment tokens of a multi-turn
  trajectory included: verl takes `attention_mask[prompt_length:].sum()`,
  and jaxcorr's multi-turn budget (`rollout.max_new_tokens` after the
  prompt) counts the same tokens.

Both are pure jitted functions of arrays; the fields that turn them on are
the `reward` section's `mask_truncated_completions` and `overlong_*`
(jaxcorr/rewards/config.py). Where they act (`penalty_at`):

* `'reward'` (DAPO, verl, NeMo-RL, AReaL): the penalty is added to the
  sequence reward before the advantage estimator, so a group-relative
  estimator sees it relative to the group;
* `'loss'`: added to each row's advantage after the estimator, so a group
  whose rows are all equally long keeps it (jaxcorr's option; no reference
  ships it).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxcorr.config.fields import (
  fail,
)
from jaxcorr.losses import masked

PENALTY_AT = ('reward', 'loss')


def check_overlong(knobs: Any, path: str) -> None:
  """Section rule: an enabled buffer needs `overlong_buffer_len >= 1`
  (`knobs`: the `reward` section, jaxcorr/rewards/config.py)."""
  if knobs.overlong_buffer_enable and knobs.overlong_buffer_len < 1:
    fail(
      f'{path}.overlong_buffer_len',
      knobs.overlong_buffer_len,
      'an int >= 1 with overlong_buffer_enable=True (the ramp divides by it)',
    )


def check_max_length(knobs: Any, max_len: int, path: str) -> None:
  """Start-up rule across sections: the buffer fits in the budget (verl
  asserts `max_resp_len >= overlong_buffer.len`)."""
  if knobs.overlong_buffer_enable and knobs.overlong_buffer_len > max_len:
    fail(
      f'{path}.overlong_buffer_len',
      knobs.overlong_buffer_len,
      f'an int in [1, rollout.max_new_tokens={max_len}]',
      'the buffer is longer than the maximum response length',
    )


@jax.jit
def overlong_penalty(
  response_mask: jax.Array,
  *,
  max_len: int | jax.Array,
  buffer_len: int | jax.Array,
  penalty_factor: float | jax.Array,
) -> jax.Array:
  """DAPO's soft overlong penalty of each row, float32 `[B]`.

  `min(−(L − (max_len − buffer_len)) / buffer_len · penalty_factor, 0)`
  with `L = Σ_t response_mask[b, t]` (module docstring: every response-side
  token, the environment's included). A row of length 0 gets 0.

  Args:
    response_mask: bool `[B, T]`: the row's response-side tokens
      (`RolloutBatch.context_mask`).
    max_len: L_max (`rollout.max_new_tokens`).
    buffer_len: L_buf >= 1.
    penalty_factor: the penalty at L = L_max.
  """
  masked.check_mask(response_mask, 'response_mask')
  # XLA's vectorised division by a broadcast scalar may round one ulp away
  # from torch's (a reciprocal): within 1e-7 of verl, not bit for bit.
  f32 = jnp.float32
  length = jnp.sum(response_mask, axis=-1, dtype=jnp.int32)
  exceed = (length - (max_len - buffer_len)).astype(f32)
  ramp = (
    -exceed / jnp.asarray(buffer_len, f32) * jnp.asarray(penalty_factor, f32)
  )
  return jnp.minimum(ramp, 0.0)


@jax.jit
def mask_truncated(mask: jax.Array, truncated: jax.Array) -> jax.Array:
  """TRL's `mask_truncated_completions`: `mask[b, t] ∧ ¬truncated[b]`.

  Args:
    mask: bool `[B, T]` loss mask.
    truncated: bool `[B]`, True for a row cut by a budget.
  """
  masked.check_mask(mask)
  return mask & ~truncated[:, None]


@jax.jit
def shape_loss(
  mask: jax.Array,
  advantages: jax.Array,
  truncated: jax.Array | None,
  penalty: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
  """The loss-time shapings on a batch after its advantages: `(mask,
  advantages)` with truncated rows out of `mask` (`mask_truncated`) and
  `penalty_b` added to row b's advantage on its mask (`'loss'` placement).

  Args:
    mask: bool `[B, T]`.
    advantages: float `[B, T]`.
    truncated: bool `[B]`, or None (no filter).
    penalty: float `[B]` from `overlong_penalty`, or None.
  """
  if penalty is not None:
    shift = jnp.where(mask, penalty[:, None], 0.0)
    advantages = advantages + shift.astype(advantages.dtype)
  if truncated is not None:
    mask = mask_truncated(mask, truncated)
  return mask, advantages
