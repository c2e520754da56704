"""Checkpoint/resume of an MoE run is exact (issue 24).

The pulse trainer with configs/arith_moe.py's policy and routing: a
Mixtral policy (8 experts, top-2), a bfloat16 engine recording routing and
a float32 trainer replaying it (`moe.router_replay='rollout'`, R3) with
the balance terms on. Stopped after step 2 and resumed in a fresh trainer,
it ends with the uninterrupted run's params and metrics, bit for bit.

Slow: 1-2 minutes on the shared 2-core CPU (~60 s of CPU time), nearly all
of it compiling the MoE engine's and trainer's programs (no other default
test compiles them at these shapes).
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from jaxcorr.train.loop import Trainer
from tests.helpers.trainer_config import pulse_config

VOLATILE = ('time/', 'perf/')


def _config(steps: int):
  return pulse_config(
    'decoupled_seq_is_rs',
    length_reward=True,
    train__sft_steps=0,  # one program fewer to compile
    train__num_steps=steps,
    train__checkpoint_every=2,
    # No evaluation: the stopped run's final eval is not part of the full run.
    train__eval_every=0,
    model__architecture='MixtralForCausalLM',
    model__num_experts=8,
    model__num_experts_per_tok=2,
    rollout__engine_dtype='bfloat16',
    moe__router_replay='rollout',
    moe__aux_loss_coef=0.01,
    moe__z_loss_coef=0.001,
  )


def _train(steps: int, workdir) -> tuple[list, list[dict]]:
  trainer = Trainer.from_config(_config(steps), str(workdir), config_name='t')
  trainer.train()
  params = jax.tree.leaves(jax.device_get(trainer.state.params))
  trainer.close()
  with open(workdir / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f]
  stable = [
    {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows
  ]
  return params, stable


@pytest.mark.slow
def test_moe_rollout_replay_run_resumes_exactly(tmp_path):
  full, part = tmp_path / 'full', tmp_path / 'part'
  want, want_rows = _train(4, full)
  _train(2, part)  # stopped after step 2 (its checkpoint)
  got, got_rows = _train(4, part)  # a fresh trainer resumes from it
  assert [r['step'] for r in got_rows] == [1, 2, 3, 4]
  for a, b in zip(want, got, strict=True):
    np.testing.assert_array_equal(a, b)
  assert got_rows == want_rows
  # The run routed and replayed: the MoE metrics are in every step.
  for r in want_rows:
    assert {'moe/router_agreement', 'moe/aux_loss', 'moe/load/e7'} <= set(r)
