"""`validate_rollout_batch` (docs/math/rollout_contract.md §7): a well-formed
batch passes; each broken rule raises a ValueError naming the field and rows."""

import dataclasses

import numpy as np
import pytest

from jaxcorr.rollout import (
  FinishReason,
  RolloutBatch,
  ValidationConfig,
  validate_rollout_batch,
)

CFG = ValidationConfig(
  vocab_size=50, temperature=0.7, top_k=5, samples_per_prompt=2
)


def good_batch() -> RolloutBatch:
  b, p, t = 4, 3, 5
  rng = np.random.default_rng(0)
  mask = np.arange(t)[None] < np.asarray([5, 3, 1, 4])[:, None]
  logp = np.where(mask, -rng.random((b, t)), 0).astype(np.float32)
  return RolloutBatch(
    prompt_tokens=rng.integers(0, 50, (b, p)).astype(np.int32),
    prompt_mask=np.ones((b, p), bool),
    response_tokens=np.where(mask, rng.integers(0, 50, (b, t)), 0).astype(
      np.int32
    ),
    context_mask=mask.copy(),
    response_mask=mask,
    rollout_logp=logp,
    rollout_logp_truncated=(logp * 0.5).astype(np.float32),
    temperature=np.full(b, 0.7, np.float32),
    top_k=np.full(b, 5, np.int32),
    top_p=np.ones(b, np.float32),
    min_p=np.zeros(b, np.float32),
    policy_version=np.where(mask, 3, -1).astype(np.int32),
    finish_reason=np.asarray([1, 0, 0, 1], np.int8),
    group_id=np.asarray([0, 0, 1, 1], np.int32),
    sample_id=np.asarray([0, 1, 0, 1], np.int32),
  )


def test_good_batch_passes_and_padding_rows_are_allowed():
  validate_rollout_batch(good_batch(), CFG)
  b = good_batch()
  pad = b.replace(
    prompt_mask=b.prompt_mask.copy(),
    context_mask=b.context_mask.copy(),
    response_mask=b.response_mask.copy(),
    finish_reason=b.finish_reason.copy(),
  )
  pad.prompt_mask[3] = pad.context_mask[3] = pad.response_mask[3] = False
  pad.finish_reason[3] = FinishReason.PAD
  validate_rollout_batch(pad, CFG)


def _set(batch, field, fn):
  x = np.array(getattr(batch, field))
  fn(x)
  return batch.replace(**{field: x})


@pytest.mark.parametrize(
  'field, mutate, cfg',
  [
    ('rollout_logp', lambda x: x.__setitem__((1, 0), 0.5), CFG),
    ('rollout_logp', lambda x: x.__setitem__((2, 0), np.nan), CFG),
    ('rollout_logp_truncated', lambda x: x.__setitem__((0, 1), -9.0), CFG),
    ('response_mask', lambda x: x.__setitem__((2, 4), True), CFG),
    ('prompt_mask', lambda x: x.__setitem__(1, False), CFG),
    ('temperature', lambda x: x.__setitem__(0, 1.0), CFG),
    ('top_k', lambda x: x.__setitem__(0, 0), CFG),
    ('group_id', lambda x: x.__setitem__(3, 7), CFG),
    ('group_id', lambda x: x.__setitem__(2, 0), CFG),
    ('policy_version', lambda x: x.__setitem__((0, 0), 9), 'v'),
    ('finish_reason', lambda x: x.__setitem__(0, 9), CFG),
    ('response_tokens', lambda x: x.__setitem__((0, 0), 50), CFG),
  ],
)
def test_each_rule_names_the_field(field, mutate, cfg):
  if cfg == 'v':
    cfg = dataclasses.replace(CFG, trainer_version=4)
  batch = _set(good_batch(), field, mutate)
  with pytest.raises(ValueError, match=rf'RolloutBatch\.{field}'):
    validate_rollout_batch(batch, cfg)


def test_missing_and_mistyped_fields():
  with pytest.raises(ValueError, match='rollout_logp: missing'):
    validate_rollout_batch(good_batch().replace(rollout_logp=None), CFG)
  with pytest.raises(ValueError, match='rollout_logp_truncated: missing'):
    validate_rollout_batch(
      good_batch().replace(rollout_logp_truncated=None), CFG
    )
  b = good_batch()
  with pytest.raises(ValueError, match=r'response_mask.*dtype'):
    validate_rollout_batch(
      b.replace(response_mask=b.response_mask.astype(np.int32)), CFG
    )


def test_staleness_per_row():
  b = good_batch()
  version = np.array(b.policy_version)
  version[1, 1] = 1
  np.testing.assert_array_equal(
    b.replace(policy_version=version).staleness(4), [1, 3, 1, 1]
  )


def test_rollout_batch_in_replay_mode_needs_kept_sets():
  """validate.py rule 9: a 'replay' batch without kept sets is refused,
  naming the field; an unknown logprob_mode is refused with the allowed
  values."""
  replay_cfg = dataclasses.replace(CFG, logprob_mode='replay')
  with pytest.raises(ValueError, match='kept_ids: missing'):
    validate_rollout_batch(good_batch(), replay_cfg)
  with pytest.raises(ValueError, match="'full', 'truncated', 'replay'"):
    validate_rollout_batch(
      good_batch(), dataclasses.replace(CFG, logprob_mode='processed')
    )
