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

from configs import arith_tiny
from jaxcorr import rewards as reward_fns
from jaxcorr.train.loop import Trainer

LENGTH_REWARD = 'test_critic_response_length'
if LENGTH_REWARD not in reward_fns.REWARDS:
  # An untrained model never solves a problem: with exact match alone every
  # reward, value target and advantage would be 0 and nothing would move.
  reward_fns.register(LENGTH_REWARD)(lambda response, answer: len(response))


def test_ppo_with_critic_trains_after_sft(tmp_path):
  config = arith_tiny.get_config('pulse')
  config.critic.enabled = True
  config.algorithm.estimator = 'gae'
  config.algorithm.gamma = 1.0
  config.algorithm.lam = 0.95
  config.train.eval_every = 0
  config.reward.functions = f'exact_match,{LENGTH_REWARD}:0.1'
  assert config.train.sft_steps > 0
  trainer = Trainer(config, str(tmp_path))
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
