"""configs/smollm2_rg.py has a pulse: SmolLM2-135M-Instruct on reasoning-gym
chain_sum through the trainer, scored by the task's own scorer, evaluated
with greedy and sampled replies (pass@k).

Slow (minutes of CPU: the 135M model's rollouts, updates and evaluation).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from configs import base, smollm2_rg
from jaxcorr.train.loop import Trainer

pytest.importorskip('reasoning_gym')

pytestmark = pytest.mark.slow


def test_pulse_scores_with_the_task_and_logs_pass_at_k(smol_dir, tmp_path):
  """Two steps of the pulse config: the reward is the task's scorer (in
  [0, 1] on every step), the start and end evaluations log greedy accuracy
  and pass@1 <= pass@2, and the eval JSONL holds the greedy and sampled
  replies of each prompt, with the rendered few-shot prompt."""

  def task(c):
    smollm2_rg.apply_task(c, model_dir=smol_dir)
    smollm2_rg.apply_pulse(c)

  trainer = Trainer.from_config(
    base.get_config('disabled', task=task), str(tmp_path)
  )
  trainer.train()
  trainer.close()
  rows = [
    json.loads(line)
    for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()
  ]
  rewards = [r['reward/reasoning_gym/mean'] for r in rows if 'time/step' in r]
  assert len(rewards) == 2 and all(0 <= x <= 1 for x in rewards), rewards
  evals = [r for r in rows if 'eval/pass@2' in r]
  assert [r['step'] for r in evals] == [0, 2]
  for r in evals:
    assert 0 <= r['eval/accuracy'] <= 1
    assert r['eval/pass@1'] <= r['eval/pass@2'] + 1e-6
  replies = [
    json.loads(line)
    for line in (tmp_path / 'eval_samples' / 'step_2.jsonl')
    .read_text()
    .splitlines()
  ]
  n = 8  # apply_pulse: train.eval_prompts
  modes = [r['mode'] for r in replies]
  assert modes.count('greedy') == n and modes.count('sampled') == 2 * n
  assert all('<answer>8</answer>' in r['prompt'] for r in replies)
  assert np.all([0 <= r['reward'] <= 1 for r in replies])
