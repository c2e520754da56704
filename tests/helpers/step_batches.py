"""One synthetic rollout batch as the trainer-step tests feed
`Steps.prepare` + `Steps.update` (tests/train/test_step.py and the
trainer-level checks of the losses), and the one-device mesh they run on.

The rollout log-probs are random, unrelated to the model: a simulated
engine mismatch for the correction to see.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxcorr import sharding
from jaxcorr.rollout.types import FinishReason, RolloutBatch
from jaxcorr.train import batch as batch_lib

B, P, T = 8, 6, 5


def synthetic_rollout(seed: int = 0) -> tuple[RolloutBatch, np.ndarray]:
  """8 rows of random prompts and responses, their rollout log-probs and
  rewards (0 or 1), two groups of 4."""
  rng = np.random.default_rng(seed)
  plen = rng.integers(2, P + 1, B)
  rlen = rng.integers(1, T + 1, B)
  prompt_mask = np.arange(P)[None] >= (P - plen)[:, None]
  mask = np.arange(T)[None] < rlen[:, None]
  logp = np.where(mask, -rng.uniform(0.1, 3.0, (B, T)), 0).astype(np.float32)
  batch = RolloutBatch(
    prompt_tokens=np.where(prompt_mask, rng.integers(3, 20, (B, P)), 0).astype(
      np.int32
    ),
    prompt_mask=prompt_mask,
    response_tokens=np.where(mask, rng.integers(3, 20, (B, T)), 0).astype(
      np.int32
    ),
    context_mask=mask,
    response_mask=mask,
    rollout_logp=logp,
    rollout_logp_truncated=logp,
    temperature=np.ones(B, np.float32),
    top_k=np.zeros(B, np.int32),
    top_p=np.ones(B, np.float32),
    min_p=np.zeros(B, np.float32),
    policy_version=np.where(mask, 0, -1).astype(np.int32),
    finish_reason=np.full(B, FinishReason.STOP, np.int8),
    group_id=np.repeat(np.arange(B // 4), 4).astype(np.int32),
    sample_id=np.tile(np.arange(4), B // 4).astype(np.int32),
  )
  return batch, rng.integers(0, 2, B).astype(np.float32)


def step_arrays(run, multiple: int):
  """`synthetic_rollout()` assembled for `Steps.prepare`, rows padded to a
  multiple of `multiple`."""
  rb, rew = synthetic_rollout()
  return batch_lib.assemble(
    rb,
    rew,
    trainer_version=0,
    max_staleness=None,
    logprob_mode='full',
    row_multiple=multiple,
  )


def one_device_mesh():
  return sharding.make_mesh(devices=jax.devices()[:1])
