"""configs/code_tiny.py runs 2 RL steps end to end on the tiny model: the
code source, the sandboxed reward, and its outcome metrics in the log."""

from __future__ import annotations

from tests.config.test_tiny_configs import _load, _two_rl_steps


def test_the_code_task_trains_two_steps_on_the_tiny_model(tmp_path):
  config = _load('code_tiny')
  assert config.reward.functions == 'code_tests'
  rows = _two_rl_steps(config, tmp_path, rollout__max_new_tokens=16)
  assert [r['step'] for r in rows] == [1, 2]
  for r in rows:
    outcomes = {k: v for k, v in r.items() if '/outcome/' in k}
    # Every reply (4 prompts x 4 samples) is scored with a reason.
    assert sum(outcomes.values()) == 16, outcomes
    assert r['reward/failures'] == 0 and r['reward/timeouts'] == 0
