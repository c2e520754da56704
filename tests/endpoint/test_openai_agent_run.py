"""An `openai` client program as the agent, through the trainer
(configs/openai_agent_tiny.py, loaded as `jaxcorr.main` loads it): 2 RL
steps in exact mode, where the engine's μ on the agent's tokens is the
trainer's π_old on the same ids bit for bit; the sessions recorded what
each reply sampled."""

from __future__ import annotations

import json

import pytest

from jaxcorr.endpoint import shared_server
from jaxcorr.train.loop import Trainer
from tests.config.test_tiny_configs import _load


def test_an_openai_client_agent_trains_with_exact_mu(tmp_path):
  config = _load('openai_agent_tiny')
  with config.unlocked():
    config.model.num_layers = 1
    config.rollout.exact = True
    config.rollout.max_new_tokens = 40
    config.train.num_steps = 2
    config.train.eval_every = 0
    config.train.checkpoint_every = 0
  trainer = Trainer.from_config(config, str(tmp_path), config_name='test')
  trainer.train()
  with open(tmp_path / 'metrics.jsonl') as f:
    rows = [r for r in map(json.loads, f) if r['step'] > 0]
  assert [r['step'] for r in rows] == [1, 2]
  for r in rows:
    # Several calls per session: the agent's messages came back as turns.
    assert r['agent/turns_mean'] > 1 and r['agent/env_tokens_mean'] > 0
    assert r['agent/env_errors'] == 0
    assert r['batch/valid_tokens'] == r['agent/agent_tokens_mean'] * 16
    # μ on the agent tokens is π_old on the same ids, bit for bit.
    assert r['rollout_corr/kl'] == 0.0
    assert r['rollout_corr/ppl_ratio'] == 1.0
  hub = shared_server('127.0.0.1', 0).hub
  records = hub.recent(16)  # the second step's sessions
  assert hub.live == 0  # every session ended with its trajectory
  for rec in records:
    tr = rec.trajectory
    assert len(rec.calls) == tr.turns > 0
    for call, (start, end) in zip(rec.calls, tr.turn_spans):
      assert call.ids == tr.tokens[start:end]
      assert call.logp == tr.logp[start:end]
      assert call.context == len(tr.prompt) + start
      assert set(call.versions) == {1}  # the second step's policy


@pytest.mark.slow  # ~70 s; CI: the sync run above, stream with agents
def test_an_openai_client_agent_trains_in_stream_mode(tmp_path):
  """`rollout.mode='stream'`: the agents' calls wait across the trainer's
  updates (scheduled swaps), and their tokens carry the versions that
  sampled them."""
  config = _load('openai_agent_tiny')
  with config.unlocked():
    config.model.num_layers = 1
    config.rollout.max_new_tokens = 40
    config.rollout.mode = 'stream'
    config.rollout.weight_sync = 'scheduled'
    config.rollout.max_staleness = 2
    config.rollout.queue_size = 2
    config.rollout.decode_chunk = 4
    config.train.num_steps = 3
    config.train.eval_every = 0
    config.train.checkpoint_every = 0
  Trainer.from_config(config, str(tmp_path), config_name='test').train()
  with open(tmp_path / 'metrics.jsonl') as f:
    rows = [r for r in map(json.loads, f) if r['step'] > 0]
  assert [r['step'] for r in rows] == [1, 2, 3]
  assert all(r['agent/env_errors'] == 0 for r in rows)
  assert all(r['agent/turns_mean'] > 1 for r in rows)
  stale = [r['staleness/token_max'] for r in rows]
  assert max(stale) > 0 and max(stale) <= 2
