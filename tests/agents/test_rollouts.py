"""`AgentRollouts` with an environment that does what a newcomer's might
(on the shared tiny engine, tests/agents/conftest.py):

* each batch's `agent/tool_<outcome>` counts are its own trajectories'
  calls, never the SFT demonstrations' (they sum to `agent/tool_calls`);
* an environment failure (reset or step raising, a NaN turn reward, ids
  outside the vocabulary, a failing demonstration) ends only its
  trajectory, as an ABORT row, counted; more than
  `agent.max_env_error_fraction` of a batch stops the run with one line
  naming the environment and its first failure;
* an environment gets the tokenizer (observations as ids without a
  closure) and a trajectory records its turn boundaries;
* `reset` may return prompt ids (used as they are), and an environment
  with `finish` is told its trajectory once it is over.
"""

import math

import numpy as np
import pytest

from jaxcorr.agents.calculator import calculator_tool
from jaxcorr.agents.config import AgentConfig
from jaxcorr.agents.environment import (
  ENVIRONMENTS,
  EnvironmentSpec,
  StepResult,
  register_environment,
)
from jaxcorr.agents.episodes import AgentRollouts
from jaxcorr.agents.failures import EnvironmentFailing
from jaxcorr.agents.tool_calls import ToolCall, ToolCallFormat
from jaxcorr.data.chat import ChatTemplate
from jaxcorr.data.tasks import Example
from jaxcorr.rollout import FinishReason
from jaxcorr.rollout.driver import request_keys
from jaxcorr.rollout.state import SamplingParams
from tests.agents.engine_setup import P, T
from tests.helpers.chat_tokenizer import CHATML

SP = SamplingParams(temperature=1.0)
NAME = 'test_scripted'
OBSERVATION = '= 42'
PROMPT_IDS = 'no template here'
FINISHED = []  # (environment, trajectory) as `finish` was told them


class Scripted:
  """Does what the row's prompt says: 'ok' calls the calculator after
  each agent turn, answers the first with `OBSERVATION` as token ids and
  ends after the second; 'reset' and 'step' raise there, 'nan' returns a
  NaN turn reward, 'ids' an id outside any vocabulary."""

  def __init__(self, session):
    self.session = session

  def reset(self, row):
    self.mode, self.turn = row.prompt, 0
    if self.mode == 'reset':
      raise KeyError('no such row')
    if self.mode == 'prompt_ids':  # the prompt as ids, used as they are
      return self.session.tokenizer.encode(PROMPT_IDS, bos=True)
    return [{'role': 'user', 'content': row.prompt}]

  def finish(self, trajectory):
    FINISHED.append((self, trajectory))

  def step(self, action):
    self.turn += 1
    if self.mode == 'step':
      raise RuntimeError('sandbox down')
    if self.mode == 'nan':
      return StepResult([], reward=math.nan)
    if self.mode == 'ids':
      return StepResult([10**6])
    self.session.run(ToolCall('calculator', {'expression': '6*7'}))
    if self.turn >= 2:
      return StepResult([], reward=1.0, done=True)
    ids = self.session.tokenizer.encode(OBSERVATION, bos=False)
    return StepResult(ids, reward=0.5)


def _expert(row, messages):
  if row.prompt == 'expert':
    raise ValueError('the expert is lost')
  return ('6*7', '42', None)[sum(m['role'] == 'assistant' for m in messages)]


if NAME not in ENVIRONMENTS:
  register_environment(NAME)(
    lambda cfg: EnvironmentSpec(
      (calculator_tool(),), ToolCallFormat(), Scripted, expert=_expert
    )
  )


@pytest.fixture
def make(setup):
  tok, _, engine, _, continuation = setup
  made = []

  def rollouts(**agent):
    cfg = AgentConfig(
      environment=NAME, max_turns=3, turn_tokens=8, max_env_tokens=16, **agent
    )
    ro = AgentRollouts(
      cfg,
      engine,
      tok,
      ChatTemplate(CHATML),
      tok.stop_ids,
      prompt_length=P,
      response_length=T,
    )
    ro.continuation = continuation  # the package's compiled program
    made.append(ro)
    return ro

  yield rollouts
  for ro in made:
    ro.close()


def _play(ro, prompts):
  """Every trajectory of `prompts` (one sample each) and their batch."""
  examples = [Example(p, '42') for p in prompts]
  decoder = ro.decoder(SP)
  for ep in ro.episodes(examples, request_keys(0, 0, len(examples), 1), 1):
    decoder.submit(ep)
  done = []
  while decoder.busy:
    done += decoder.advance()
  decoder.close()
  trajectories = sorted((e.trajectory for e in done), key=lambda t: t.row)
  return trajectories, ro.collect(done, SP, env_time_share=0.0)


def test_each_batch_counts_its_own_tool_calls(make):
  ro = make()
  demos = ro.demonstrations([Example('ok', '42')] * 3)  # 2 calls each
  assert [d.turns for d in demos] == [2, 2, 2]
  _, out = _play(ro, ['ok', 'ok'])
  m = out.metrics
  outcomes = sum(v for k, v in m.items() if k.startswith('agent/tool_') and
                 k not in ('agent/tool_calls', 'agent/tool_call_rate'))  # fmt: skip
  assert m['agent/tool_calls'] == 4 == m['agent/tool_ok'] == outcomes
  assert m['agent/tool_call_rate'] == 1.0


def test_an_environment_gets_the_tokenizer_and_turns_are_recorded(make, setup):
  tok = setup[0]
  (tr,), _ = _play(make(), ['ok'])
  assert tr.turns == len(tr.turn_spans) == 2 and not tr.error
  (a0, a1), (b0, b1) = tr.turn_spans
  assert a0 == 0 and b1 == len(tr.tokens)
  # Between the turns: exactly the environment's ids, no agent token.
  assert tr.tokens[a1:b0] == tok.encode(OBSERVATION, bos=False)
  agent = np.asarray(tr.agent)
  assert agent[a0:a1].all() and agent[b0:b1].all() and not agent[a1:b0].any()
  assert tr.turn_rewards == [0.5, 1.0]


def test_environment_failures_end_only_their_trajectories(make):
  trajectories, out = _play(
    make(max_env_error_fraction=1.0), ['ok', 'reset', 'step', 'nan', 'ids']
  )
  ok, *failed = trajectories
  assert ok.finish != FinishReason.ABORT and not ok.error
  assert [t.error.split(':')[0] for t in failed] == ['reset', *['step'] * 3]
  assert 'KeyError' in failed[0].error and failed[0].prompt == []
  assert 'RuntimeError: sandbox down' in failed[1].error
  assert 'not a finite number' in failed[2].error
  assert 'outside the vocabulary' in failed[3].error
  # ABORT rows (the update drops them; not the engine's ERROR rows that
  # rollout.max_error_fraction bounds), counted, with finite rewards.
  finish = np.asarray(out.batch.finish_reason).tolist()
  assert finish[1:] == [FinishReason.ABORT] * 4
  assert out.metrics['agent/env_errors'] == 4
  assert np.isfinite(out.turn_rewards).all()
  assert out.turn_rewards[0] == 1.5


def test_too_many_failures_stop_the_run_in_one_line(make):
  ro = make()  # the default bound: half of a batch
  _play(ro, ['step', 'ok', 'ok'])  # 1 of 3: a warning, the run goes on
  with pytest.raises(EnvironmentFailing) as err:
    _play(ro, ['step', 'reset', 'ok'])
  msg = str(err.value)
  assert '\n' not in msg
  assert msg.startswith(
    f"environment '{NAME}' failed on 2 of 3 trajectories "
    '(> config.agent.max_env_error_fraction=0.5); first: step: '
    'RuntimeError: sandbox down (' + __file__
  )


def test_failed_demonstrations_are_empty_rows_within_the_bound(make):
  examples = [Example(p, '42') for p in ('ok', 'step', 'expert')]
  demos = make(max_env_error_fraction=1.0).demonstrations(examples)
  assert demos[0].turns == 2 and any(demos[0].agent)
  assert [(d.prompt, d.tokens) for d in demos[1:]] == [([], [])] * 2
  with pytest.raises(EnvironmentFailing, match=r'2 of 3 demonstrations .* '
                     r'first: demonstration: RuntimeError: sandbox down'):  # fmt: skip
    make().demonstrations(examples)


def test_reset_may_return_prompt_ids_and_finish_gets_the_trajectory(
  make, setup
):
  tok = setup[0]
  FINISHED.clear()
  (ids, chat), _ = _play(make(), ['prompt_ids', 'ok'])
  assert ids.prompt == tok.encode(PROMPT_IDS, bos=True)
  assert chat.prompt != ids.prompt and not ids.error
  assert sorted(t.row for _, t in FINISHED) == [0, 1]
  assert {id(t) for _, t in FINISHED} == {id(ids), id(chat)}
