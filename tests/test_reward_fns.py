"""Reward functions, the spec parser and the fail-safe RewardScorer."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from jaxcorr.train import reward_fns as R

# -- built-in rewards --------------------------------------------------------


def test_exact_match_and_arith_exact():
  assert R.REWARDS['exact_match']('42', ' 42 ') == 1.0
  assert R.REWARDS['exact_match'](' 42\n', '42') == 1.0
  assert R.REWARDS['exact_match']('042', '42') == 0.0
  assert R.REWARDS['exact_match']('42 43', '42') == 0.0
  assert R.REWARDS['arith_exact']('-14', '-14') == 1.0
  assert R.REWARDS['arith_exact']('14', '-14') == 0.0


@pytest.mark.parametrize(
  ('response', 'answer', 'expected'),
  [
    ('The answer is #### 72', '72', 1.0),
    ('The answer is #### 72', '71', 0.0),
    ('#### 1,234 dollars', '1234', 1.0),
    ('#### $18.', '18', 1.0),
    ('so #### 5 \n then #### 6', '6', 1.0),
    (r'\boxed{3.0}', '3', 1.0),
    (r'first \boxed{2} then \boxed{\frac{1}{2}}', '0.5', 1.0),
    (r'\boxed{x + 1}', 'x+1', 1.0),
    ('She has 3 apples and 5 pears, so 8 in total.', '8', 1.0),
    ('She has 3 apples and 5 pears, so 8 in total.', '5', 0.0),
    ('the ratio is 3/4', '0.75', 1.0),
    ('no number here', '8', 0.0),
    ('#### 72', 'Natalia sold 24 in May.\n#### 72', 1.0),
    ('#### -5', '-5', 1.0),
    ('#### 5', '-5', 0.0),
    ('42.0000001', '42', 1.0),
    ('42.001', '42', 0.0),
  ],
)
def test_math_answer(response, answer, expected):
  assert R.REWARDS['math_answer'](response, answer) == expected


@pytest.mark.parametrize(
  ('response', 'expected'),
  [
    ('so #### 72', 1.0),
    ('####-3.5', 1.0),
    (r'\boxed{12}', 1.0),
    (r'\boxed{\frac{1}{2}}', 1.0),
    ('72', 0.0),
    ('#### seventy-two', 0.0),
    (r'\boxed{}', 0.0),
    (r'\boxed{12', 0.0),
  ],
)
def test_format(response, expected):
  assert R.REWARDS['format'](response, 'unused') == expected


def test_register(monkeypatch):
  monkeypatch.setattr(R, 'REWARDS', dict(R.REWARDS))

  @R.register('length_penalty')
  def penalty(response, answer):
    return -len(response) / 100

  assert R.REWARDS['length_penalty'] is penalty
  with pytest.raises(ValueError, match='registered already'):
    R.register('length_penalty')(lambda r, a: 0.0)
  R.register('length_penalty', override=True)(R.exact_match)
  assert R.REWARDS['length_penalty'] is R.exact_match
  with pytest.raises(ValueError, match='reward name'):
    R.register('a:b')


# -- spec --------------------------------------------------------------------


def test_parse_spec():
  assert R.parse_spec('math_answer:1.0,format:0.1') == [
    ('math_answer', 1.0),
    ('format', 0.1),
  ]
  assert R.parse_spec(' exact_match ') == [('exact_match', 1.0)]
  assert R.parse_spec('a: -0.5 , b') == [('a', -0.5), ('b', 1.0)]
  for bad in ('', 'a:x', 'a:1,,b', ':1', 'a:nan', 'a b:1'):
    with pytest.raises(ValueError, match=r'config\.reward\.functions'):
      R.parse_spec(bad)


# -- scorer ------------------------------------------------------------------


@pytest.fixture
def registry(monkeypatch):
  """Registers test rewards for one test only."""

  def add(name, fn):
    monkeypatch.setitem(R.REWARDS, name, fn)

  return add


def test_scorer_weighted_sum_and_metrics():
  scorer = R.RewardScorer(
    R.parse_spec('exact_match:2.0,format:0.5'), timeout_s=2.0
  )
  rewards, metrics = scorer.score(
    ['#### 1', '7', '#### 2', ' 8 '], ['#### 1', '7', '3', '8']
  )
  assert rewards.dtype == np.float32
  np.testing.assert_array_equal(rewards, [2.5, 2.0, 0.5, 2.0])
  assert metrics == {
    'reward/failures': 0.0,
    'reward/timeouts': 0.0,
    'reward/exact_match/mean': 0.75,
    'reward/format/mean': 0.5,
  }
  inline = R.RewardScorer(
    R.parse_spec('exact_match:2.0,format:0.5'), timeout_s=0
  )
  again, _ = inline.score(
    ['#### 1', '7', '#### 2', ' 8 '], ['#### 1', '7', '3', '8']
  )
  np.testing.assert_array_equal(again, rewards)
  scorer.close()


def test_scorer_unknown_name_and_bad_arguments():
  with pytest.raises(ValueError, match=r'config\.reward\.functions') as e:
    R.RewardScorer([('exact_match', 1.0), ('bleu', 1.0)])
  assert "unknown reward 'bleu'" in str(e.value)
  assert "'exact_match'" in str(e.value) and "'math_answer'" in str(e.value)
  with pytest.raises(ValueError, match='more than once'):
    R.RewardScorer([('format', 1.0), ('format', 2.0)])
  with pytest.raises(ValueError, match='invalid weight'):
    R.RewardScorer([('format', float('inf'))])
  with pytest.raises(ValueError, match=r'config\.reward\.timeout_s'):
    R.RewardScorer([('format', 1.0)], timeout_s=-1)
  with pytest.raises(ValueError, match='2 responses but 1 answers'):
    R.RewardScorer([('format', 1.0)], timeout_s=0).score(['a', 'b'], ['a'])


@pytest.mark.parametrize('timeout_s', [0, 2.0])
def test_scorer_contains_raising_and_invalid_rewards(registry, timeout_s):
  def flaky(response, answer):
    if response == 'boom':
      raise RuntimeError('reward crashed')
    if response == 'nan':
      return float('nan')
    if response == 'text':
      return 'yes'
    return 1.0

  registry('flaky', flaky)
  scorer = R.RewardScorer(
    [('flaky', 1.0), ('exact_match', 10.0)], timeout_s=timeout_s
  )
  responses = ['ok', 'boom', 'nan', 'text', 'ok']
  rewards, metrics = scorer.score(responses, ['ok', 'boom', 'x', 'x', 'x'])
  np.testing.assert_array_equal(rewards, [11.0, 10.0, 0.0, 0.0, 1.0])
  assert metrics['reward/failures'] == 3.0
  assert metrics['reward/timeouts'] == 0.0
  assert metrics['reward/flaky/mean'] == pytest.approx(0.4)
  scorer.close()


def test_scorer_timeout_returns_promptly_and_recovers(registry):
  release = threading.Event()

  def slow(response, answer):
    if response == 'hang':
      release.wait(10.0)  # far past the timeout; released at the end
    return 1.0

  registry('slow', slow)
  scorer = R.RewardScorer([('slow', 1.0)], timeout_s=0.2, max_workers=2)
  try:
    for _ in range(2):  # the second call runs on replacement workers
      start = time.monotonic()
      rewards, metrics = scorer.score(['hang', 'ok', 'hang', 'ok'], ['a'] * 4)
      elapsed = time.monotonic() - start
      assert elapsed < 2.0
      np.testing.assert_array_equal(rewards, [0.0, 1.0, 0.0, 1.0])
      assert metrics['reward/timeouts'] == 2.0
      assert metrics['reward/failures'] == 0.0
    # Every worker hung: queued calls still get a fresh worker.
    start = time.monotonic()
    _, metrics = scorer.score(['hang'] * 3 + ['ok'], ['a'] * 4)
    assert metrics['reward/timeouts'] == 3.0
    assert metrics['reward/slow/mean'] == 0.25
    assert time.monotonic() - start < 3.0
  finally:
    release.set()
    scorer.close()
