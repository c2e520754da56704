"""The documented tool-call format: calls parsed from the agent's text; a
malformed call raises `MalformedToolCall` (the environment turns it into
an error observation)."""

import pytest

from jaxcorr.agents.calculator import calculator_tool
from jaxcorr.agents.tool_calls import (
  MalformedToolCall,
  ToolCall,
  ToolCallFormat,
  parse_tool_calls,
)
from jaxcorr.agents.tool_runner import ToolRunner
from jaxcorr.agents.tools import Tool

HERMES = ToolCallFormat()


def test_hermes_json_calls():
  text = (
    'Let me compute. <tool_call>{"name": "calculator", "arguments": '
    '{"expression": "12*34"}}</tool_call> and <tool_call>{"name": "f", '
    '"arguments": "{\\"x\\": 1}"}</tool_call>'
  )
  assert parse_tool_calls(text, HERMES) == [
    ToolCall('calculator', {'expression': '12*34'}),
    ToolCall('f', {'x': 1}),
  ]
  assert parse_tool_calls('The answer is 408.', HERMES) == []


@pytest.mark.parametrize(
  'text',
  [
    '<tool_call>{"name": "calculator"',  # unclosed
    '<tool_call>{"name": calculator}</tool_call>',  # not JSON
    '<tool_call>[1, 2]</tool_call>',  # not an object
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
  ],
)
def test_malformed(text):
  with pytest.raises(MalformedToolCall):
    parse_tool_calls(text, HERMES)


def test_text_body_and_render_round_trip():
  fmt = ToolCallFormat(start='(', end=')', body='text', default_tool='calc')
  call = ToolCall('calc', {'expression': '17*25'})
  text = fmt.render(call, 'expression')
  assert text == '(17*25)'
  assert parse_tool_calls(text, fmt, 'expression') == [call]
  assert parse_tool_calls(HERMES.render(call), HERMES) == [call]
  with pytest.raises(ValueError, match='default_tool'):
    ToolCallFormat(body='text')


def test_a_text_body_needs_no_argument_name():
  """The format names the tool; the tool's schema names the parameter the
  body fills, when the call runs."""
  fmt = ToolCallFormat(
    start='(', end=')', body='text', default_tool='calculator'
  )
  (call,) = parse_tool_calls('Let me see: (17*25)', fmt)
  assert call == ToolCall('calculator', text='17*25')
  runner = ToolRunner([calculator_tool()], timeout_s=2.0, workers=1)
  try:
    assert runner.run(call) == ('425', 'ok')
  finally:
    runner.close()
  # Rendering needs no name either: the call's one argument.
  assert fmt.render(ToolCall('calculator', {'expression': '1+2'})) == '(1+2)'
  assert fmt.render(call) == '(17*25)'


def test_a_text_call_of_a_tool_without_one_parameter_is_an_argument_error():
  two = {
    'type': 'object',
    'properties': {'a': {'type': 'string'}, 'b': {'type': 'string'}},
  }
  runner = ToolRunner([Tool('two', 'd', two, lambda **kw: 'x')], workers=1)
  try:
    content, outcome = runner.run(ToolCall('two', text='1'))
  finally:
    runner.close()
  assert outcome == 'arguments' and 'fills one parameter' in content
