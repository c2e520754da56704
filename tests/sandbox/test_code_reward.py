"""`code_tests` through the scorer: each hostile reply scores 0 with its
reason in `reward/code_tests/outcome/<reason>`; the python tool; the code
task's rows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxcorr.agents.code_tool import code_tool
from jaxcorr.data.prompts import make_eval_source, make_source
from jaxcorr.rewards import REWARDS, Outcome, RewardScorer
from jaxcorr.rewards import code as code_reward
from jaxcorr.sandbox import runner

TESTS = json.dumps({'tests': ['f(2) == 4', 'f(-3) == -6']})


def _block(code: str) -> str:
  return f'Here you go:\n```python\n{code}\n```\n'


def test_hostile_replies_score_zero_with_their_reason(monkeypatch):
  # A 1 s sandbox (the registered reward's is 3 s) keeps the test fast.
  fast = runner.Limits(timeout_s=1.0, cpu_s=1)
  monkeypatch.setitem(REWARDS, 'code_tests', code_reward.make_code_reward(fast))
  replies = {
    'passed': _block('def f(x):\n  return 2 * x'),
    'failed_tests': _block('def f(x):\n  return 4'),
    'no_code': 'I do not know.',
    'error': _block('raise SystemExit(0)\ndef f(x): return 2 * x'),
    'timeout': _block('while True: pass'),
    'memory': _block('x = bytearray(10 * 1024 ** 3)'),
    'output_limit': _block('while True: print("x" * 4096)'),
  }
  spoof = _block('print("0000 2 2")\ndef f(x): return 0')
  scorer = RewardScorer([('code_tests', 1.0)], timeout_s=10, max_workers=4)
  try:
    rewards, metrics = scorer.score([*replies.values(), spoof], [TESTS] * 8)
  finally:
    scorer.close()
  np.testing.assert_allclose(rewards, [1, 0.5, 0, 0, 0, 0, 0, 0])
  assert metrics['reward/failures'] == metrics['reward/timeouts'] == 0
  counts = {
    k.rsplit('/', 1)[1]: v for k, v in metrics.items() if '/outcome/' in k
  }
  assert counts == {**dict.fromkeys(replies, 1.0), 'failed_tests': 2.0}


def test_a_bad_reference_is_a_counted_failure():
  with pytest.raises(ValueError, match='code_tests: reference answer'):
    code_reward.code_tests(_block('def f(x): return x'), '{"tests": []}')


def test_the_outcome_survives_a_worker_process():
  scorer = RewardScorer(
    [('code_tests', 1.0)], timeout_s=20, max_workers=1, isolation='process'
  )
  try:
    _, metrics = scorer.score([_block('def f(x):\n  return 2 * x')], [TESTS])
  finally:
    scorer.close()
  assert metrics['reward/code_tests/outcome/passed'] == 1.0


def test_the_python_tool_reports_output_errors_and_limits():
  tool = code_tool(runner.Limits(timeout_s=1.0, cpu_s=1), max_chars=50)
  assert tool.schema()['function']['name'] == 'python'
  assert tool.fn(code='print(6 * 7)') == '42\n'
  assert 'ZeroDivisionError' in tool.fn(code='1 / 0')
  assert tool.fn(code='while True: pass').endswith('[timeout]')
  assert 'more characters]' in tool.fn(code='print("x" * 500)')
  assert Outcome(0.0, 'x').reason == 'x'


def test_the_code_task_rows_are_deterministic_and_self_consistent():
  rows = make_source({'source': 'code', 'num_examples': 40, 'seed': 3})
  again = make_source({'source': 'code', 'num_examples': 40, 'seed': 3})
  assert rows[7] == again[7] and len(rows) == 40
  evals = make_eval_source({'source': 'code', 'num_examples': 40, 'seed': 3})
  assert len(evals) == 256 and evals[0] != rows[0]
  # Each row's tests hold for the function the prompt describes.
  for ex in rows[:8]:
    tests = code_reward.parse_tests(ex.answer)
    assert len(tests) == 5 and ex.prompt.startswith('Write a Python function')
