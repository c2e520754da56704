"""OpenEnv (openenv-core): an environment served by OpenEnv's own server
and reached through its client, trained by the trainer
(configs/openenv_tiny.py, loaded as `jaxcorr.main` loads it)."""

from __future__ import annotations

from jaxcorr.hubs.openenv_env import action_of, render_observation
from tests.config.test_tiny_configs import _load, _two_rl_steps


def test_turns_become_actions_and_observations_text():
  one = {'type': 'object', 'required': ['answer']}
  assert action_of(' 7 ', one) == {'answer': '7'}
  assert action_of('{"answer": "7"}', one) == {'answer': '7'}
  assert action_of('7', {'required': ['a', 'b']}) is None
  assert render_observation({'text': 'hi', 'done': False, 'reward': 0}) == 'hi'
  both = {'text': 'hi', 'n': 2, 'metadata': {}}
  assert render_observation(both) == '{"text": "hi", "n": 2}'


def test_an_openenv_game_trains_on_the_tiny_model(tmp_path):
  config = _load('openenv_tiny')
  _load('openenv_tiny')  # loaded twice in one process: one server
  rows = _two_rl_steps(config, tmp_path, rollout__max_new_tokens=40)
  assert [r['step'] for r in rows] == [1, 2]
  for r in rows:
    # Several turns: the game's 'higher' / 'lower' came back as turns.
    assert r['agent/turns_mean'] > 1 and r['agent/env_tokens_mean'] > 0
    assert r['agent/env_errors'] == 0
    assert abs(r['rollout_corr/kl']) < 1e-4
