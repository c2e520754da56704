"""Rollouts: the batch the engine hands to the trainer (`types`), its host
checks (`validate`), the JetStream engine over the policy model (`engine`,
its data in `state`, its jitted device functions in `decode`, an
ids-as-text `tokenizer`) and the offline
continuous-batching driver (`driver`).
"""

from jaxcorr.rollout.types import FinishReason, RolloutBatch
from jaxcorr.rollout.validate import ValidationConfig, validate_rollout_batch

__all__ = [
  'FinishReason',
  'RolloutBatch',
  'ValidationConfig',
  'validate_rollout_batch',
]
