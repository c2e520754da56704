"""The SFT warm-up's demonstrations: the calculator expert played through
the real environment, built as RL builds a trajectory (agent tokens with
their end token, observations as template deltas), the loss on the
agent's tokens only."""

import dataclasses

import numpy as np
import pytest

from configs import arith_tool
from jaxcorr.agents import environment as env_lib
from jaxcorr.agents.demonstrations import demonstrate, turn_end_id
from jaxcorr.agents.tool_calls import ToolCall
from jaxcorr.agents.tool_runner import ToolRunner
from jaxcorr.agents.turns import ARITH_TOOL_TEMPLATE, TurnFormat
from jaxcorr.data.chat import ChatTemplate
from jaxcorr.data.tasks import CharTokenizer, Example
from jaxcorr.train import sft
from jaxcorr.train.build import build
from tests.helpers.chat_tokenizer import CHATML, chat_tokenizer

ROW = Example('17*25=', '425')


def _spec(**agent):
  run = build(arith_tool.get_config('pulse'))
  cfg = dataclasses.replace(run.agent, **agent)
  return run, env_lib.environment_spec('calculator', cfg)


@pytest.fixture
def runner():
  _, spec = _spec()
  r = ToolRunner(spec.tools, timeout_s=5.0, workers=1)
  yield r
  r.close()


def test_arith_demonstration_calls_the_tool_then_answers(runner):
  _, spec = _spec()
  tok = CharTokenizer()
  turns = TurnFormat(ChatTemplate(ARITH_TOOL_TEMPLATE), tok)
  end = turn_end_id(turns, tok, (tok.eos_id,))
  assert end == tok.eos_id  # the template's tail '\n' is no stop token
  d = demonstrate(spec, runner, turns, tok, end, ROW, max_turns=3)
  assert d.turns == 2
  assert tok.decode(d.prompt) == 'Q: 17*25=?\nA: '
  agent = [t for t, a in zip(d.tokens, d.agent) if a]
  env = [t for t, a in zip(d.tokens, d.agent) if not a]
  call = [*tok.encode('(17*25)', bos=False), end]
  answer = [*tok.encode('425', bos=False), end]
  assert agent == call + answer
  # The observation is the real tool's result, as the template's delta.
  tool = [{'role': 'tool', 'content': '425'}]
  assert env == turns.env_ids(tool, end)
  assert d.tokens == call + env + answer
  assert runner.take_counts()['ok'] == 1


def test_chatml_demonstration_is_the_rendered_conversation(runner):
  """With special tokens: prompt + demonstration equals the encoding of
  the template's rendering of the whole conversation (no drift), and the
  sampled end token is not repeated by the delta."""
  tok, _ = chat_tokenizer()
  _, spec = _spec(
    call_body='json', call_start='<tool_call>', call_end='</tool_call>'
  )
  turns = TurnFormat(ChatTemplate(CHATML), tok)
  end = turn_end_id(turns, tok, (tok.eos_id,))
  assert tok.encode('<|im_end|>', bos=False) == [end]
  d = demonstrate(spec, runner, turns, tok, end, ROW, max_turns=3)
  call = spec.call_format.render(
    ToolCall('calculator', {'expression': '17*25'})
  )
  conversation = [
    *spec.make(runner).reset(ROW),
    {'role': 'assistant', 'content': call},
    {'role': 'tool', 'content': '425'},
    {'role': 'assistant', 'content': '425'},
  ]
  whole = ChatTemplate(CHATML).render(conversation, add_generation_prompt=False)
  assert d.prompt + d.tokens == tok.encode(whole)[:-1]  # no final '\n'


def test_an_expert_past_max_turns_is_an_error(runner):
  _, spec = _spec()
  tok = CharTokenizer()
  turns = TurnFormat(ChatTemplate(ARITH_TOOL_TEMPLATE), tok)
  with pytest.raises(ValueError, match=r'config\.agent\.max_turns=1'):
    demonstrate(spec, runner, turns, tok, tok.eos_id, ROW, max_turns=1)


def test_demonstration_batch_trains_agent_tokens_only(runner):
  run, spec = _spec()
  tok = CharTokenizer()
  turns = TurnFormat(ChatTemplate(ARITH_TOOL_TEMPLATE), tok)
  d = demonstrate(spec, runner, turns, tok, tok.eos_id, ROW, max_turns=3)
  batch = sft.demonstration_batch(run, [d])
  p, t = run.rollout.max_prompt_length, run.rollout.max_new_tokens
  assert batch.tokens.shape == (1, p + t)
  n = len(d.prompt) + len(d.tokens)
  np.testing.assert_array_equal(batch.tokens[0, :n], d.prompt + d.tokens)
  assert batch.segment_ids[0].sum() == n
  # loss_mask[j] reads the prediction of token j + 1.
  trained = np.flatnonzero(batch.loss_mask[0]) + 1 - len(d.prompt)
  np.testing.assert_array_equal(trained, np.flatnonzero(d.agent))
  # Cut at T after the prompt, like a sampled trajectory.
  short = dataclasses.replace(
    run, rollout=dataclasses.replace(run.rollout, max_new_tokens=5)
  )
  cut = sft.demonstration_batch(short, [d])
  assert cut.tokens.shape == (1, p + 5)
  assert cut.loss_mask[0].sum() == 5


def test_sft_with_an_environment_without_expert_fails_at_config_time():
  name = 'test_no_expert'
  if name not in env_lib.ENVIRONMENTS:

    @env_lib.register_environment(name)
    def _no_expert(cfg):
      spec = env_lib.calculator_environment(cfg)
      return dataclasses.replace(spec, expert=None)

  c = arith_tool.get_config('pulse')
  c.agent.environment = name
  with pytest.raises(ValueError, match=r'config\.train\.sft_steps'):
    build(c)
  c.train.sft_steps = 0
  assert build(c).agent.environment == name
