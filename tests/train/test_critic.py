"""The trainer with a critic (PPO with GAE) after the SFT warm-up.

`init_from_policy` used to hand the critic the policy's own arrays, so the
first update after SFT donated one buffer twice and crashed ("Attempt to
donate the same buffer twice"); no trainer test ran a critic.
"""

from __future__ import annotations

import json
import math

import jax
import numpy as np
from flax import nnx

from jaxcorr.train.loop import Trainer
from tests.helpers.trainer_config import pulse_config


def test_ppo_with_critic_trains_after_sft(tmp_path):
  # With exact match alone every reward, value target and advantage of an
  # untrained model would be 0 and nothing would move.
  config = pulse_config(
    length_reward=True,
    critic__enabled=True,
    algorithm__estimator='gae',
    algorithm__gamma=1.0,
    algorithm__lam=0.95,
    train__eval_every=0,
  )
  assert config.train.sft_steps > 0
  trainer = Trainer.from_config(config, str(tmp_path))
  trainer.train()
  trainer.close()
  assert trainer.step == config.train.num_steps
  lines = (tmp_path / 'metrics.jsonl').read_text().splitlines()
  rows = [json.loads(line) for line in lines]
  assert [r['step'] for r in rows] == [1, 2, 3]
  for r in rows:
    for k in ('critic/vf_loss', 'critic/vf_clipfrac', 'critic/vpred_mean'):
      assert math.isfinite(r[k]), (k, r)
  # The critic's backbone started from the SFT policy and was then trained
  # apart from it: its own buffers, now with other values.
  critic = nnx.merge(trainer.steps.critic_graphdef, trainer.state.critic_params)
  policy = nnx.merge(trainer.graphdef, trainer.state.params)
  assert np.any(np.asarray(critic.head[...]) != 0)  # the head learned
  c = jax.tree.leaves(nnx.state(critic.backbone, nnx.Param))
  p = jax.tree.leaves(nnx.state(policy, nnx.Param))
  assert len(c) == len(p)
  assert any(
    not np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(c, p)
  )
