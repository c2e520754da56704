"""`RolloutBatch`: what the rollout engine hands to the trainer
(`docs/math/rollout_contract.md` §4-§5).

Layout: prompts left-padded [B, P], responses right-padded [B, T] from
t = 0; `rollout_logp[i, t]` is log μ(response_tokens[i, t] | prompt_i,
response_i[:t]) at the sequence's temperature (0.0 off the policy tokens).
Samples of one prompt are adjacent rows sharing a `group_id`.
"""

from __future__ import annotations

import enum

import flax.struct
import jax
import numpy as np


class FinishReason(enum.IntEnum):
  """Why a row ended (`finish_reason`, int8)."""

  STOP = 0
  LENGTH = 1
  ABORT = 2
  ERROR = 3
  PAD = 4


@flax.struct.dataclass
class RolloutBatch:
  """One batch of rollouts; arrays may be numpy (host) or jax (device).

  Shapes: B rows, P prompt slots, T response slots.
  """

  prompt_tokens: jax.Array  # [B, P] int32, left-padded
  prompt_mask: jax.Array  # [B, P] bool
  response_tokens: jax.Array  # [B, T] int32, right-padded
  context_mask: jax.Array  # [B, T] bool, every real response-side token
  response_mask: jax.Array  # [B, T] bool, policy tokens (subset)
  # log μ: the full value of docs/math/rollout_contract.md §1 and the
  # truncated value of docs/math/rollout_contract.md §2.
  rollout_logp: jax.Array | None  # [B, T] float32, full value
  rollout_logp_truncated: jax.Array | None  # [B, T] float32, truncated
  temperature: jax.Array  # [B] float32
  top_k: jax.Array  # [B] int32, 0 = off
  top_p: jax.Array  # [B] float32, 1.0 = off
  min_p: jax.Array  # [B] float32, 0.0 = off
  policy_version: jax.Array  # [B, T] int32, -1 off the policy tokens
  finish_reason: jax.Array  # [B] int8 FinishReason
  group_id: jax.Array  # [B] int32, prompt index
  sample_id: jax.Array  # [B] int32, index within the group
  seq_reward: jax.Array | None = None  # [B] float32, after scoring
  # logprob_mode='replay' (rollout/kept_set.py): each token's kept set,
  # width C, -1 past kept_count; None when the engine records none.
  kept_ids: jax.Array | None = None  # [B, T, C] int32
  kept_count: jax.Array | None = None  # [B, T] int32
  kept_capped: jax.Array | None = None  # [B, T] bool
  # MoE policies (docs/moe.md): the experts each MoE layer chose for every
  # token the engine fed (prompt then response, the trainer's P + T layout),
  # -1 where none (padding, the last sampled token); None for dense models.
  routed_experts: jax.Array | None = None  # [B, P + T, L_moe, k] int32
  # The prompt's task, an index into jaxcorr/data/task_ids.py's table (-1:
  # none); set by the trainer's scoring, None from a bare engine.
  task_id: jax.Array | None = None  # [B] int32
  # Logging only. The dtypes the engine stores its matmul weights and KV
  # cache in (`precision.stored_dtypes`): 'int8' / 'float8_e4m3fn' for a
  # quantized engine, whatever its compute dtype.
  engine_name: str = flax.struct.field(pytree_node=False, default='')
  param_dtype: str = flax.struct.field(pytree_node=False, default='')
  kv_cache_dtype: str = flax.struct.field(pytree_node=False, default='')

  @property
  def batch_size(self) -> int:
    return self.response_tokens.shape[0]

  @property
  def response_length(self) -> int:
    return self.response_tokens.shape[1]

  def staleness(self, trainer_version: int) -> np.ndarray:
    """[B] trainer_version - min policy_version over each row's policy
    tokens (0 for rows without any), on the host."""
    version = np.asarray(self.policy_version)
    mask = np.asarray(self.response_mask)
    oldest = np.where(mask, version, np.iinfo(np.int32).max).min(axis=1)
    return np.where(mask.any(axis=1), trainer_version - oldest, 0)
