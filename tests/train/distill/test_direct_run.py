"""The direct distillation presets through the whole trainer
(configs/arith_opd_tiny.py's pulse, as tests/train/test_distill_run.py):
the teacher is the pulse model's scratch init (a 0-step run saves it), the
student starts from the same init and trains 2 steps with the task reward
kept, so step 1 sees no gap and step 2 one."""

from __future__ import annotations

import json

import numpy as np
import pytest

from configs import arith_opd_tiny
from jaxcorr.train.loop import Trainer
from tests.helpers.trainer_config import LENGTH_REWARD, pulse_config


@pytest.fixture(scope='module')
def teacher(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('teacher')
  config = pulse_config(
    train__num_steps=0, train__sft_steps=0, train__eval_every=0
  )
  Trainer.from_config(config, str(workdir), config_name='test').train()
  return workdir


@pytest.mark.parametrize('preset', ['opd_direct_k3', 'opd_topk', 'opd_gjsd'])
def test_direct_preset_pulse_run(teacher, tmp_path, preset):
  config = arith_opd_tiny.get_config(f'pulse+{preset}')
  config.distill.teacher = str(teacher)
  config.distill.task_reward = True
  config.reward.functions = f'exact_match,{LENGTH_REWARD}:0.1'
  config.train.num_steps = 2
  config.train.eval_every = 0
  Trainer.from_config(config, str(tmp_path), config_name='test').train()
  with open(tmp_path / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f if '"step": 0' not in line]
  assert [r['step'] for r in rows] == [1, 2]
  first, second = (r['distill/loss'] for r in rows)
  assert abs(first) < 1e-6  # the teacher is the student's init
  assert second > 1e-6  # the task reward moved the student
  for r in rows:
    assert np.isfinite(r['actor/loss']) and np.isfinite(r['actor/grad_norm'])
