"""Rollouts: the batch the engine hands to the trainer (`types`), its host
checks (`validate`), the JetStream engine over the policy model (`engine`,
composed of `layout`, the device functions of `decode`, `policy_weights`,
JetStream's one-request API in `requests` and the batched path in
`batched`; its data in `state`, sampling-mask replay's kept sets in
`kept_set`, an ids-as-text `tokenizer`, and `tf_startup`, which keeps
TensorFlow's start-up lines off the console), continuous batching
(`decoder`) and the offline driver (`driver`).
"""

from jaxcorr.rollout.types import FinishReason, RolloutBatch
from jaxcorr.rollout.validate import ValidationConfig, validate_rollout_batch

__all__ = [
  'FinishReason',
  'RolloutBatch',
  'ValidationConfig',
  'validate_rollout_batch',
]
