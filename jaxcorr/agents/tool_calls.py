"""The tool-call format: how a model's output names a tool and its
arguments, and the parser that reads it.

The default is the Hermes / Qwen format that verl, SkyRL and Tunix tool
agents use, a JSON object between tags::

  <tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>

Any number of calls may appear in one turn; text outside the tags is the
agent's prose (a turn with no call is its final answer). `body='text'`
is a compact form for small vocabularies (the character model of
configs/arith_tool.py has no braces or quotes): the text between the tags
is the one argument of `default_tool`, e.g. `(12*34)` with `start='('`,
`end=')'`. The parser keeps it as `ToolCall.text`; the tool's schema names
the parameter it fills (its first required one, `Tool.text_arguments`)
when the call runs, so neither the parser nor the environment needs it.

A malformed call (an unclosed tag, JSON that does not parse, no `name`,
`arguments` that are not an object) raises `MalformedToolCall`, whose
message becomes the agent's error observation: the episode goes on, the
call is counted as malformed, nothing crashes.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any


class MalformedToolCall(ValueError):
  """The output holds a tool call that cannot be parsed."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One parsed call: the tool's name and its keyword arguments, or with
  a 'text' body the body itself (`text`; the tool's one argument)."""

  name: str
  arguments: dict[str, Any] = dataclasses.field(default_factory=dict)
  text: str | None = None


@dataclasses.dataclass(frozen=True)
class ToolCallFormat:
  """Where calls are in the text and how their body reads."""

  start: str = '<tool_call>'
  end: str = '</tool_call>'
  body: str = 'json'  # 'json' or 'text' (module docstring)
  default_tool: str = ''  # the tool a 'text' body calls

  def __post_init__(self):
    if self.body not in ('json', 'text'):
      raise ValueError(
        f"ToolCallFormat.body: invalid value {self.body!r}; allowed: 'json', "
        "'text'"
      )
    if not self.start or not self.end:
      raise ValueError('ToolCallFormat: start and end tags must be non-empty')
    if self.body == 'text' and not self.default_tool:
      raise ValueError("ToolCallFormat: body='text' needs a default_tool")

  def render(self, call: ToolCall, argument_name: str = '') -> str:
    """The text of `call` in this format (demonstrations, tests). A 'text'
    body carries `call.text`, else the argument `argument_name`, else the
    call's only argument."""
    if self.body == 'text':
      return f'{self.start}{_text_of(call, argument_name)}{self.end}'
    body = json.dumps({'name': call.name, 'arguments': call.arguments})
    return f'{self.start}{body}{self.end}'


def parse_tool_calls(
  output: str, fmt: ToolCallFormat, text_argument: str = ''
) -> list[ToolCall]:
  """Every call in `output`, in order ([] for a final answer).

  Args:
    output: the agent turn's decoded text.
    fmt: the format.
    text_argument: with `body='text'`, the parameter the body fills;
      '' (the default) keeps the body as `ToolCall.text`, which the tool's
      schema resolves when the call runs (`Tool.text_arguments`).

  Raises:
    MalformedToolCall: the first call that cannot be parsed.
  """
  calls, pos = [], 0
  while (i := output.find(fmt.start, pos)) >= 0:
    j = output.find(fmt.end, i + len(fmt.start))
    if j < 0:
      raise MalformedToolCall(
        f'unclosed {fmt.start!r}: no {fmt.end!r} after it'
      )
    body = output[i + len(fmt.start) : j]
    pos = j + len(fmt.end)
    if fmt.body == 'text':
      if text_argument:
        calls.append(ToolCall(fmt.default_tool, {text_argument: body}))
      else:
        calls.append(ToolCall(fmt.default_tool, text=body))
      continue
    calls.append(_json_call(body))
  return calls


def _text_of(call: ToolCall, argument_name: str) -> Any:
  if call.text is not None:
    return call.text
  if argument_name:
    return call.arguments[argument_name]
  if len(call.arguments) != 1:
    raise ValueError(
      f'render: a text body carries one argument; {call.name!r} has '
      f'{sorted(call.arguments)} (name one with argument_name)'
    )
  return next(iter(call.arguments.values()))


def _json_call(body: str) -> ToolCall:
  try:
    obj = json.loads(body)
  except json.JSONDecodeError as err:
    raise MalformedToolCall(f'the call is not valid JSON ({err.msg})') from err
  if not isinstance(obj, dict):
    raise MalformedToolCall('the call must be a JSON object')
  name = obj.get('name')
  if not isinstance(name, str) or not name:
    raise MalformedToolCall('the call has no "name" string')
  args = obj.get('arguments', {})
  if isinstance(args, str):  # some models emit the arguments as a string
    try:
      args = json.loads(args)
    except json.JSONDecodeError as err:
      raise MalformedToolCall(f'"arguments" is not JSON ({err.msg})') from err
  if not isinstance(args, dict):
    raise MalformedToolCall('"arguments" must be an object')
  return ToolCall(name, args)
