"""`ToolEnvironment`: a turn with calls gets the tools' results, a turn
without is the answer, a malformed call is an error observation."""

import pytest

from jaxcorr.agents.calculator import calculator_tool
from jaxcorr.agents.config import AgentConfig
from jaxcorr.agents.environment import (
  ToolEnvironment,
  environment_spec,
)
from jaxcorr.agents.tool_calls import ToolCallFormat
from jaxcorr.agents.tool_runner import ToolRunner
from jaxcorr.data.tasks import Example


def _env(**kw):
  runner = ToolRunner([calculator_tool()], timeout_s=2.0)
  return ToolEnvironment(runner, ToolCallFormat(), **kw), runner


def test_calls_results_and_answer():
  runner = ToolRunner([calculator_tool()], timeout_s=2.0)
  session = runner.session()
  env = ToolEnvironment(session, ToolCallFormat(), system='tools here')
  assert env.reset(Example('What is 12*34?', '408')) == [
    {'role': 'system', 'content': 'tools here'},
    {'role': 'user', 'content': 'What is 12*34?'},
  ]
  call = (
    '<tool_call>{"name": "calculator", "arguments": {"expression": '
    '"12*34"}}</tool_call>'
  )
  out = env.step(call)
  assert not out.done
  assert out.observation == [{'role': 'tool', 'content': '408'}]
  assert session.counts == {'ok': 1}  # the calls of this trajectory
  final = env.step('408')
  assert final.done and final.observation == []
  runner.close()


def test_malformed_call_is_an_error_observation():
  env, runner = _env()
  out = env.step('<tool_call>{"name": calculator}</tool_call>')
  assert not out.done
  assert out.info == {'malformed_calls': 1}
  assert out.observation[0]['content'].startswith('error: the call is not')
  bad = env.step(
    '<tool_call>{"name": "calculator", "arguments": {"expression": '
    '"__import__(1)"}}</tool_call>'
  )
  assert bad.observation[0]['content'].startswith('error: CalculatorError')
  assert runner.take_counts()['error'] == 1
  terse, _ = _env(terse_errors=True)
  assert terse.step('<tool_call>x</tool_call>').observation[0]['content'] == '?'
  runner.close()


def test_registry_names_the_known_environments():
  spec = environment_spec('calculator', AgentConfig(environment='calculator'))
  assert [t.name for t in spec.tools] == ['calculator']
  with pytest.raises(ValueError, match=r"allowed: '' .*calculator"):
    environment_spec('nope', AgentConfig())
