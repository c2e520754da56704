"""Reward functions, the spec parser and the fail-safe RewardScorer."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from jaxcorr import rewards as R
from jaxcorr.train import preemption

# A catastrophic backtrack: `re` holds the GIL for the whole (astronomic)
# match, so no other thread of its process runs, signal handlers included.
_BACKTRACK = re.compile(r'(a+)+$')


@R.register('test_holds_gil')
def _holds_gil(response: str, answer: str) -> bool:
  """Registered at import, so a worker process finds it too."""
  if response == 'evil':
    _BACKTRACK.match('a' * 64 + 'b')
  return response == answer


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
  # One registry object, shared by the package and its modules.
  assert R.REWARDS is R.registry.REWARDS is R.scorer.REWARDS
  monkeypatch.delitem(R.REWARDS, 'length_penalty', raising=False)

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
    'reward/stuck_calls': 0.0,
    'reward/budget_exceeded': 0.0,
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


def test_hanging_reward_without_call_timeout_is_cut_by_the_step_budget(
  registry,
):
  """timeout_s=0 (no per-call limit) used to call inline and freeze the
  loop forever; now the step budget bounds `score`, and the healthy
  function's values are kept."""
  release = threading.Event()
  registry('hangs', lambda r, a: release.wait(30.0) and 1.0)
  scorer = R.RewardScorer(
    [('hangs', 1.0), ('exact_match', 1.0)], timeout_s=0, step_budget_s=0.5
  )
  try:
    start = time.monotonic()
    rewards, metrics = scorer.score(['a', 'b'], ['a', 'x'])
    assert time.monotonic() - start < 5.0
    np.testing.assert_array_equal(rewards, [1.0, 0.0])
    assert metrics['reward/timeouts'] == 2.0
    assert metrics['reward/budget_exceeded'] == 1.0
    assert metrics['reward/stuck_calls'] == 2.0
    assert metrics['reward/exact_match/mean'] == 0.5
  finally:
    release.set()
    scorer.close()


def test_a_stop_cuts_a_hanging_call_short(registry):
  """SIGTERM while a reward hangs: `score` used to wait out the whole step
  budget (300 s by default, past a preemption's ~30 s grace), so the run
  was SIGKILLed before its checkpoint. Once `stop_requested()` is true the
  calls get `STOP_GRACE_S` more; a healthy call in flight still counts."""
  release, stop = threading.Event(), threading.Event()

  def hangs(response, answer):
    if response == 'slow':
      time.sleep(0.3)  # healthy, in flight when the stop comes
      return 2.0
    release.wait(60.0)
    return 1.0

  registry('hangs', hangs)
  scorer = R.RewardScorer([('hangs', 1.0)], timeout_s=0, step_budget_s=60)
  scorer.stop_requested = stop.is_set
  threading.Timer(0.2, stop.set).start()
  try:
    start = time.monotonic()
    rewards, metrics = scorer.score(['a', 'slow'], ['x', 'x'])
    elapsed = time.monotonic() - start
    assert R.scorer.STOP_GRACE_S <= elapsed < R.scorer.STOP_GRACE_S + 5
    np.testing.assert_array_equal(rewards, [0.0, 2.0])
    assert metrics['reward/timeouts'] == 1.0
    assert metrics['reward/budget_exceeded'] == 1.0
  finally:
    release.set()
    scorer.close()


def test_stuck_calls_never_starve_later_calls(registry, monkeypatch):
  """Past MAX_STUCK hanging calls the hanging function gets no new threads
  (its rows time out at once), while healthy functions, in this scorer and
  in another one (the evaluation's), keep being scored. Before, after 64
  abandoned calls every later call timed out."""
  monkeypatch.setattr(R.scorer, 'MAX_STUCK', 3)
  release = threading.Event()

  def hang_or_match(response, answer):
    if response == 'hang':
      release.wait(30.0)
    return float(response == answer)

  registry('hang_or_match', hang_or_match)
  train = R.RewardScorer(
    [('hang_or_match', 1.0), ('exact_match', 2.0)],
    timeout_s=0.1,
    max_workers=2,
  )
  evaluation = R.RewardScorer([('exact_match', 1.0)], timeout_s=0.1)
  try:
    # 2 hangs per step: the cap is passed in step 2, so in step 3 every
    # row of the hanging function is skipped, 'a' included.
    for expected in ([0.0, 3.0, 0.0], [0.0, 3.0, 0.0], [0.0, 2.0, 0.0]):
      rewards, metrics = train.score(['hang', 'a', 'hang'], ['x', 'a', 'y'])
      np.testing.assert_array_equal(rewards, expected)
    assert metrics['reward/stuck_calls'] == 4.0
    assert metrics['reward/timeouts'] == 3.0  # skipped: over the cap
    assert metrics['reward/exact_match/mean'] == pytest.approx(1 / 3)
    start = time.monotonic()
    rewards, metrics = evaluation.score(['a', 'b'] * 8, ['a', 'c'] * 8)
    assert time.monotonic() - start < 2.0
    assert metrics['reward/timeouts'] == 0.0
    np.testing.assert_array_equal(rewards, [1.0, 0.0] * 8)
  finally:
    release.set()
    train.close()
    evaluation.close()
  # The hung calls return: the function gets threads again.
  deadline = time.monotonic() + 10
  while train._get_pool().stuck() and time.monotonic() < deadline:
    time.sleep(0.01)
  _, metrics = train.score(['a'], ['a'])
  assert metrics['reward/hang_or_match/mean'] == 1.0
  train.close()


def test_values_are_checked_in_float32(registry):
  """1e39 is finite in float64, inf in float32 (the update's dtype): a
  failure of the function that returned it, not a NaN loss later."""
  registry('huge', lambda r, a: 1e39 if r == 'huge' else 3e38)
  rewards, metrics = R.RewardScorer([('huge', 1.0)]).score(
    ['huge', 'ok'], ['', '']
  )
  assert rewards.dtype == np.float32
  np.testing.assert_array_equal(rewards, [0.0, np.float32(3e38)])
  assert metrics['reward/failures'] == 1.0
  # Each value fits, the weighted sum does not: that row scores 0.
  rewards, metrics = R.RewardScorer([('huge', 10.0)]).score(['ok'], [''])
  np.testing.assert_array_equal(rewards, [0.0])
  assert metrics['reward/failures'] == 1.0


def test_check_rewards_blames_the_rewards():
  np.testing.assert_array_equal(
    R.check_rewards(np.asarray([1.0, -2.0])), np.float32([1.0, -2.0])
  )
  with pytest.raises(
    ValueError, match=r'1 of 3 are not finite in float32.*row 1 = 1e\+39'
  ):
    R.check_rewards(np.asarray([0.0, 1e39, 2.0]))
  with pytest.raises(ValueError, match=r'reward\.functions'):
    R.check_rewards([np.nan], np.float32)
  with pytest.raises(ValueError, match=r'config\.reward\.step_budget_s'):
    R.RewardScorer([('format', 1.0)], step_budget_s=-1)


@pytest.mark.parametrize('isolation', ['thread', 'process'])
def test_bools_score_0_or_1(registry, isolation):
  """`return pred == gold` (a bool, or numpy's) used to fail on every call
  and train on zeros."""
  registry('np_bool', lambda r, a: np.str_(r) == np.str_(a))
  registry('array_bool', lambda r, a: np.asarray(r == a))
  names = ['np_bool', 'array_bool']
  if isolation == 'process':
    names = ['test_holds_gil']  # a worker finds only registered-at-import
  scorer = R.RewardScorer([(n, 1.0) for n in names], isolation=isolation)
  try:
    rewards, metrics = scorer.score(['7', '8'], ['7', '9'])
  finally:
    scorer.close()
  np.testing.assert_array_equal(rewards, [len(names), 0.0])
  assert metrics['reward/failures'] == 0.0
  # A weight is a number, not a bool.
  with pytest.raises(ValueError, match='invalid weight True'):
    R.RewardScorer([('exact_match', True)])


def test_a_function_failing_on_every_row_stops_the_run(registry):
  """A reward failing on (nearly) every row of FAILING_SCORES batches in a
  row raises, naming the function and its first failure; one that fails on
  some rows, or with max_failure_fraction=1, scores them 0 and goes on."""
  registry('broken', lambda r, a: {'score': 1})
  registry('half', lambda r, a: 1.0 if r == 'a' else None)
  scorer = R.RewardScorer([('broken', 1.0), ('half', 1.0)], timeout_s=0)
  for _ in range(R.scorer.FAILING_SCORES - 1):
    rewards, metrics = scorer.score(['a', 'b'], ['a', 'b'])
    np.testing.assert_array_equal(rewards, [1.0, 0.0])
    assert metrics['reward/failures'] == 3.0
  with pytest.raises(R.RewardFunctionFailing) as err:
    scorer.score(['a', 'b'], ['a', 'b'])
  msg = str(err.value)
  assert "reward 'broken' failed" in msg and "'half'" not in msg, msg
  assert "first failure: returned {'score': 1}, not a finite float32" in msg
  assert 'config.reward.max_failure_fraction=0.9' in msg
  scorer.close()
  # A batch in which it works resets the count.
  registry('flaky', lambda r, a: 1.0 if r == 'ok' else None)
  scorer = R.RewardScorer([('flaky', 1.0)], timeout_s=0)
  for responses in (['x'], ['x'], ['ok'], ['x'], ['x']):
    scorer.score(responses, [''])
  scorer = R.RewardScorer([('broken', 1.0)], max_failure_fraction=1)
  for _ in range(R.scorer.FAILING_SCORES + 1):
    scorer.score(['a'], ['a'])
  scorer.close()
  with pytest.raises(ValueError, match=r'config\.reward\.max_failure_frac'):
    R.RewardScorer([('format', 1.0)], max_failure_fraction=1.5)
  with pytest.raises(ValueError, match=r'config\.reward\.isolation'):
    R.RewardScorer([('format', 1.0)], isolation='fork')


@pytest.mark.parametrize(
  'timeout_s, step_budget_s', [(0, 0), (0, 300), (None, None)]
)
def test_a_stop_without_limits_names_the_stop(
  registry, caplog, timeout_s, step_budget_s
):
  """timeout_s=0 and step_budget_s=0 (no limits), then a stop: the log line
  of the call cut short used to format None (TypeError, no checkpoint);
  with a budget it blamed the budget, not the stop."""
  release, stop = threading.Event(), threading.Event()
  registry('hangs', lambda r, a: release.wait(60.0) and 1.0)
  scorer = R.RewardScorer(
    [('hangs', 1.0)], timeout_s=timeout_s, step_budget_s=step_budget_s
  )
  scorer.stop_requested = stop.is_set
  threading.Timer(0.2, stop.set).start()
  try:
    with caplog.at_level(logging.WARNING, logger='jaxcorr.rewards.scorer'):
      _, metrics = scorer.score(['a'], ['a'])
  finally:
    release.set()
    scorer.close()
  assert metrics['reward/timeouts'] == 1.0
  assert "reward 'hangs' timed out: the run is stopping" in caplog.text
  assert 'step budget' not in caplog.text


def test_process_isolation_kills_a_gil_holding_call_and_goes_on():
  """`isolation='process'`: a call holding the GIL is killed at its
  timeout; its row scores 0, the other rows keep their values, and the
  next batch is scored by a fresh worker. (Under 'thread' the same call
  stalls the whole process.)"""
  scorer = R.RewardScorer(
    [('test_holds_gil', 1.0), ('exact_match', 2.0)],
    timeout_s=1.0,
    isolation='process',
    max_workers=2,
  )
  try:
    scorer.start()
    start = time.monotonic()
    rewards, metrics = scorer.score(['evil', '7', '8'], ['x', '7', '9'])
    assert time.monotonic() - start < 10
    np.testing.assert_array_equal(rewards, [0.0, 3.0, 0.0])
    assert metrics['reward/timeouts'] == 1.0
    assert metrics['reward/stuck_calls'] == 0.0
    for _ in range(3):  # every slot gets a call: the killed one restarts
      rewards, _ = scorer.score(['1', '2'], ['1', '2'])
      np.testing.assert_array_equal(rewards, [3.0, 3.0])
  finally:
    scorer.close()


def test_process_isolation_honours_sigterm_while_a_call_holds_the_gil():
  """SIGTERM while a reward holds the GIL, with no limits: the trainer's
  handler runs (its process is free), the stop cuts the call after the
  grace, and the worker is killed."""
  scorer = R.RewardScorer(
    [('test_holds_gil', 1.0)],
    timeout_s=0,
    step_budget_s=0,
    isolation='process',
    max_workers=1,
  )
  scorer.start()
  timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
  try:
    with preemption.PreemptionGuard() as guard:
      scorer.stop_requested = lambda: guard.requested
      timer.start()
      start = time.monotonic()
      rewards, metrics = scorer.score(['evil'], ['x'])
      elapsed = time.monotonic() - start
      assert guard.requested
  finally:
    timer.cancel()
    scorer.close()
  assert elapsed < R.scorer.STOP_GRACE_S + 5
  np.testing.assert_array_equal(rewards, [0.0])
  assert metrics['reward/timeouts'] == 1.0


def test_process_isolation_refuses_a_reward_a_fresh_process_lacks(registry):
  registry('local_only', lambda r, a: 1.0)
  with pytest.raises(ValueError, match="'local_only' are not registered"):
    R.RewardScorer([('local_only', 1.0)], isolation='process').start()


_PROBE_CONFIG = """
import re

from configs import arith_tiny
from jaxcorr import rewards

_BACKTRACK = re.compile(r'(a+)+$')


@rewards.register('probe_holds_gil')
def holds_gil(response, answer):
  if len(response) % 2:  # about half the rows hold the GIL for ever
    _BACKTRACK.match('a' * 64 + 'b')
  return 0.0


def get_config(config_string=None):
  return arith_tiny.get_config(config_string)
"""


@pytest.mark.slow
def test_trainer_with_process_isolation_survives_a_gil_holding_reward(
  tmp_path,
):
  """`python -m jaxcorr.main` with a reward registered in its config file
  that holds the GIL on half the rows: under reward.isolation='process' the
  steps go on (those calls time out) and SIGTERM checkpoints and exits 75."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  config = tmp_path / 'probe_cfg.py'
  config.write_text(_PROBE_CONFIG)
  workdir = tmp_path / 'run'
  proc = subprocess.Popen(
    [
      sys.executable,
      '-m',
      'jaxcorr.main',
      f'--config={config}:pulse',
      '--config.reward.functions=exact_match,probe_holds_gil',
      '--config.reward.isolation=process',
      '--config.reward.timeout_s=1',
      '--config.reward.step_budget_s=0',
      '--config.train.num_steps=1000',
      '--config.train.eval_every=0',
      '--config.train.checkpoint_every=0',
      f'--workdir={workdir}',
    ],
    cwd=root,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  try:
    deadline = time.monotonic() + 600
    steps = []
    while len(steps) < 2 and time.monotonic() < deadline:
      assert proc.poll() is None, proc.communicate()[0][-3000:]
      time.sleep(0.5)
      if (workdir / 'metrics.jsonl').exists():
        lines = (workdir / 'metrics.jsonl').read_text().splitlines()
        steps = [json.loads(x) for x in lines if x.strip()]
    assert len(steps) >= 2, 'no RL steps logged'
    assert all(r['reward/timeouts'] > 0 for r in steps if r['step'] > 0)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == preemption.EXIT_PREEMPTED, out[-3000:]
  assert 'preempted: checkpoint at step' in out
