"""OpenEnv (openenv-core): an environment served by OpenEnv's own server
and reached through its client, trained by the trainer
(configs/openenv_tiny.py, loaded as `jaxcorr.main` loads it)."""

from __future__ import annotations

import pytest

from jaxcorr.agents.config import AgentConfig
from jaxcorr.agents.environment import environment_spec
from jaxcorr.data.tasks import Example
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


def test_a_trajectory_is_one_session_of_the_openenv_server():
  """The adapter against the config's OpenEnv server (its own process's
  `create_app`, reached over OpenEnv's client): the opening observation,
  actions from text or JSON, a text the schema cannot take, the game's
  rewards and its end."""
  from configs import openenv_tiny as oe

  spec = environment_spec(oe.NAME, AgentConfig(environment=oe.NAME))
  env = spec.make(None)
  (opening,) = env.reset(Example('3+4=', '7'))
  a, b = map(int, opening['content'].rstrip('=').split('+'))
  assert opening['role'] == 'user'
  low = env.step(str(a + b - 1))
  assert low.observation == [{'role': 'tool', 'content': 'higher'}]
  assert low.reward == 0.0 and not low.done
  garbled = env.step('{"answer": "1"')  # bad JSON: the text is the answer
  assert garbled.observation[0]['content'] in ('higher', 'lower')
  right = env.step(f'{{"answer": "{a + b}"}}')
  assert right.done and right.reward == 1.0
  assert env.client is None  # the session is closed


@pytest.mark.slow  # ~90 s; CI: the adapter above, the trainer's agents
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
