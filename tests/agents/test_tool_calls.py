"""The documented tool-call format: calls parsed from the agent's text; a
malformed call raises `MalformedToolCall` (the environment turns it into
an error observation)."""

import pytest

from jaxcorr.agents.tool_calls import (
  MalformedToolCall,
  ToolCall,
  ToolCallFormat,
  parse_tool_calls,
)

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
