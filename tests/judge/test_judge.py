"""The judge: its verdict parser on fixed replies, its config errors, and
an end-to-end call on a tiny random model (plumbing, batching, failure
accounting through the scorer)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from jaxcorr.data.text import ByteTokenizer
from jaxcorr.judge import (
  DEFAULT_VERDICT,
  Judge,
  JudgeConfig,
  UnparsedVerdict,
  bind_policy_judges,
  compile_verdict,
  parse_verdict,
  register_judge,
)
from jaxcorr.rewards import REWARDS, RewardScorer
from jaxcorr.rollout.engine import PolicyEngine
from tests.helpers.model_testing import random_model, tiny_config


@pytest.mark.parametrize(
  'reply, pattern, value',
  [
    ('Reasoning... Score: 7', DEFAULT_VERDICT, 0.7),
    ('Score: 10\nScore: 2', DEFAULT_VERDICT, 1.0),  # the first verdict
    ('Score:12', DEFAULT_VERDICT, 1.0),  # clipped to max_score
    ('Score: -3', DEFAULT_VERDICT, 0.0),
    ('Score: 2.5', DEFAULT_VERDICT, 0.25),
    ('Verdict: YES', r'Verdict:\s*(\w+)', 1.0),
    ('verdict: no.', r'(?i)verdict:\s*(\w+)', 0.0),
  ],
)
def test_verdicts_parse(reply, pattern, value):
  assert parse_verdict(reply, re.compile(pattern), 10.0) == pytest.approx(value)


@pytest.mark.parametrize(
  'reply, pattern',
  [
    ('I think it is fine', DEFAULT_VERDICT),
    ('Verdict: maybe', r'Verdict: (\w+)'),
  ],
)
def test_a_reply_without_a_verdict_is_unparsed(reply, pattern):
  with pytest.raises(UnparsedVerdict):
    parse_verdict(reply, re.compile(pattern), 10.0)


def test_bad_judge_settings_name_the_field():
  with pytest.raises(ValueError, match=r'JudgeConfig\.verdict: .*2 groups'):
    JudgeConfig(verdict='(a)(b)')
  with pytest.raises(ValueError, match=r'verdict: .*allowed: a regex'):
    compile_verdict('(')
  with pytest.raises(
    ValueError, match=r'JudgeConfig\.rubric: .*no \{response\}'
  ):
    JudgeConfig(rubric='grade {answer}')
  with pytest.raises(ValueError, match=r'JudgeConfig\.max_score'):
    JudgeConfig(max_score=0)


@pytest.fixture(scope='module')
def engine():
  cfg = tiny_config(
    vocab_size=ByteTokenizer.vocab_size,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    max_position_embeddings=128,
  )
  return PolicyEngine(
    random_model(cfg),
    max_concurrent_decodes=8,
    max_prefill_length=64,
    max_target_length=72,
    decode_chunk=8,
    min_attend_bucket=72,
  )


def test_the_judge_grades_in_batches_and_counts_its_failures(engine):
  # A random model's reply holds a digit now and then: '(\\d)' parses
  # those (N / 9) and leaves the others unparsed, so both paths run.
  config = JudgeConfig(
    model='policy',
    rubric='{answer}?{response}:',
    verdict=r'(\d)',
    max_score=9,
    max_new_tokens=8,
    batch_size=8,
    gather_s=0.2,
  )
  responses = [f'reply {i}' for i in range(12)] + ['x' * 80]  # too long
  answers = [str(i % 5) for i in range(13)]
  judge = register_judge('test_judge', config)
  with pytest.raises(RuntimeError, match="model='policy' has no engine"):
    judge.grade(responses[:1], answers[:1])
  judge.bind(engine, ByteTokenizer())
  # Row by row (one generate each): the reference for the batched path.
  alone = [judge.grade([r], [a])[0] for r, a in zip(responses, answers)]
  assert isinstance(alone[-1], ValueError) and 'tokens' in str(alone[-1])
  scored = [v for v in alone if isinstance(v, float)]
  unparsed = [v for v in alone if isinstance(v, UnparsedVerdict)]
  assert scored and unparsed, alone  # both paths ran
  scorer = RewardScorer([('test_judge', 1.0)], timeout_s=60, max_workers=8)
  try:
    rewards, metrics = scorer.score(responses, answers)
  finally:
    scorer.close()
    del REWARDS['test_judge']
  expected = [v if isinstance(v, float) else 0.0 for v in alone]
  assert rewards.tolist() == pytest.approx(expected)
  assert metrics['reward/failures'] == len(alone) - len(scored)
  assert max(judge.batch_sizes) > 1  # rows shared a generate


def test_a_judge_registered_again_replaces_its_own():
  first = register_judge('test_judge_twice', JudgeConfig())
  second = register_judge('test_judge_twice', JudgeConfig())
  assert REWARDS['test_judge_twice'] is second is not first
  del REWARDS['test_judge_twice']
  with pytest.raises(ValueError, match='registered already'):
    register_judge('exact_match', JudgeConfig())
  assert isinstance(first, Judge)


def test_the_policy_judges_the_trainer_s_rollouts(tmp_path):
  """A judge with model='policy' in a 2-step run grades on the rollout
  engine (bound by the trainer); its unparsed verdicts are counted."""
  from tests.config.test_tiny_configs import _load, _two_rl_steps

  config = _load('arith_tiny')
  with config.unlocked():
    config.reward.functions = 'exact_match,policy_judge:0.1'
  # The character vocabulary: a rubric of digits and '=?' only.
  judge = register_judge(
    'policy_judge',
    JudgeConfig(rubric='{answer}?{response}=', verdict=r'(\d)', max_score=9),
  )
  try:
    rows = _two_rl_steps(config, tmp_path, rollout__max_new_tokens=8)
  finally:
    del REWARDS['policy_judge']
  assert judge._engine is not None and judge.batch_sizes
  for r in rows:
    assert 0 <= r['reward/policy_judge/mean'] <= 1
    assert r['reward/timeouts'] == 0


def test_a_policy_judge_needs_sync_rollouts():
  judge = register_judge('async_judge', JudgeConfig())
  try:
    with pytest.raises(ValueError, match=r"rollout\.mode='sync' only"):
      bind_policy_judges(
        ['exact_match', 'async_judge'],
        None,
        None,
        SimpleNamespace(mode='async'),
      )
  finally:
    del REWARDS['async_judge']
  assert judge._engine is None
