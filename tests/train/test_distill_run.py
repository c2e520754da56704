"""On-policy distillation through the whole trainer (configs/arith_opd_tiny.py's
pulse, 8 fake CPU devices): the teacher is the pulse model's scratch init
(a run of 0 steps saves it as checkpoint 0), the student starts from the
same init and distils for 2 steps with the task reward kept (opd_rl) and
the teacher served as the engine holds it (opd_engine)."""

from __future__ import annotations

import json

import jax
import numpy as np

from configs import arith_opd_tiny
from jaxcorr.train.loop import Trainer
from tests.helpers.trainer_config import LENGTH_REWARD, pulse_config


def test_distillation_pulse_run(tmp_path):
  teacher = tmp_path / 'teacher'
  config = pulse_config(
    train__num_steps=0, train__sft_steps=0, train__eval_every=0
  )
  Trainer.from_config(config, str(teacher), config_name='test').train()

  config = arith_opd_tiny.get_config('pulse+opd_rl')
  config.distill.teacher = str(teacher)
  config.distill.logp_source = 'engine'
  config.rollout.engine_dtype = 'bfloat16'  # a teacher gap to report
  config.reward.functions = f'exact_match,{LENGTH_REWARD}:0.1'
  config.train.num_steps = 2
  config.train.eval_every = 0
  student = tmp_path / 'student'
  trainer = Trainer.from_config(config, str(student), config_name='test')
  before = jax.tree.map(np.asarray, trainer.rl_step.teacher.params)
  trainer.train()
  with open(student / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f if '"step": 0' not in line]
  assert [r['step'] for r in rows] == [1, 2]
  # Step 1: the teacher is the student's π_old (one forward): zero KL.
  assert rows[0]['distill/reverse_kl'] == 0.0
  # The task reward moved the student; step 2 sees a gap to the teacher.
  assert rows[1]['distill/reverse_kl'] != 0.0
  for r in rows:
    assert np.isfinite(r['actor/loss'])
    # The bfloat16 engine's teacher against its float32 trainer-side pass.
    assert r['teacher_corr/log_ppl_abs_diff'] > 0.0
    assert np.isfinite(r['teacher_corr/chi2_token'])
  after = jax.tree.map(np.asarray, trainer.rl_step.teacher.params)
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b)  # nothing trains the teacher
