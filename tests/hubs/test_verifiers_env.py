"""verifiers: an environment on `verifiers.v1`'s classes, its episodes run
by verifiers (Env, harness, interception server, rubric) against the
endpoint, trained by the trainer (configs/verifiers_tiny.py, loaded as
`jaxcorr.main` loads it)."""

from __future__ import annotations

import json

import pytest

from jaxcorr.endpoint import shared_server
from tests.config.test_tiny_configs import _load, _two_rl_steps


@pytest.mark.slow  # ~90 s; CI: the rubric test below, the endpoint's run
def test_a_verifiers_environment_trains_on_the_tiny_model(tmp_path):
  config = _load('verifiers_tiny')
  with open(config.data.path) as f:
    rows = [json.loads(line) for line in f]
  assert rows[0] == {'prompt': rows[0]['prompt'], 'answer': '0'}
  assert len(rows) == 64
  steps = _two_rl_steps(config, tmp_path, rollout__max_new_tokens=40)
  assert [r['step'] for r in steps] == [1, 2]
  for r in steps:
    # verifiers' game loop answered: several model calls per episode.
    assert r['agent/turns_mean'] > 1 and r['agent/env_tokens_mean'] > 0
    assert r['agent/env_errors'] == 0
    assert abs(r['rollout_corr/kl']) < 1e-4
  # Each trajectory's calls were the episode's model calls.
  for rec in shared_server('127.0.0.1', 0).hub.recent(16):
    assert len(rec.calls) == rec.trajectory.turns > 0


def test_the_rubric_score_is_the_turn_reward():
  """The test plays the engine: the episode's first call gets a wrong
  answer, the game's 'higher' / 'lower' comes back as the new message
  only, the right answer ends it, and the rubric's 1.0 is the reward."""
  from configs import verifiers_tiny as vt
  from jaxcorr.agents.tool_calls import ToolCallFormat
  from jaxcorr.data.tasks import Example
  from jaxcorr.data.text import ByteTokenizer
  from jaxcorr.endpoint import AgentEnvironment, EndpointSettings

  task = vt.AGENT.tasks[0].data
  env = AgentEnvironment(
    shared_server('127.0.0.1', 0),
    vt.AGENT,
    EndpointSettings(),
    ToolCallFormat(),
    ByteTokenizer(),
  )
  assert env.reset(Example(task.prompt, '0')) == [
    {'role': 'user', 'content': task.prompt}
  ]
  wrong = env.step('99')
  assert wrong.observation == [{'role': 'user', 'content': 'lower'}]
  right = env.step(task.answer)
  assert right.done and right.reward == 1.0
