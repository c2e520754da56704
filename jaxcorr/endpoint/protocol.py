"""The OpenAI wire format: requests checked into plain values, replies built
from an agent turn's text, errors as OpenAI writes them.

    chat_request(body)          -> ChatRequest (messages, tools, stream)
    completion_request(body)    -> CompletionRequest (prompt, stream)
    chat_reply(text, fmt, ...)  -> a `chat.completion` object; tool calls in
                                   the text (`jaxcorr.agents.tool_calls`
                                   format, Hermes by default) become
                                   OpenAI `tool_calls`
    completion_reply(text, ...) -> a `text_completion` object
    ApiError                    -> {"error": {"message", "type", "param",
                                   "code"}} with its HTTP status

What a request cannot change: the sampling. Temperature, top_p, max_tokens,
stop, seed and logprobs are the trainer's (`config.rollout`, `config.agent.
turn_tokens`): the engine samples every turn with the policy's sampling
parameters, so the recorded μ is the distribution the correction divides by.
They are accepted and ignored; `n` other than 1 is refused (one session is
one trajectory).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from jaxcorr.agents.tool_calls import (
  MalformedToolCall,
  ToolCall,
  ToolCallFormat,
  parse_tool_calls,
)

ROLES = ('system', 'developer', 'user', 'assistant', 'tool')
MODEL = 'jaxcorr-policy'


class ApiError(Exception):
  """An OpenAI-style error reply (`body()`), with its HTTP status."""

  def __init__(
    self,
    status: int,
    message: str,
    *,
    kind: str = 'invalid_request_error',
    param: str | None = None,
    code: str | None = None,
  ):
    super().__init__(message)
    self.status, self.message = status, message
    self.kind, self.param, self.code = kind, param, code

  def body(self) -> dict[str, Any]:
    return {
      'error': {
        'message': self.message,
        'type': self.kind,
        'param': self.param,
        'code': self.code,
      }
    }


def bad(message: str, param: str | None = None, code: str | None = None):
  return ApiError(400, message, param=param, code=code)


@dataclasses.dataclass(frozen=True)
class ChatRequest:
  messages: list[dict[str, Any]]  # role, content (text) and call fields
  tools: list[dict[str, Any]]
  stream: bool


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
  prompt: str
  stream: bool


def _object(body: Any) -> dict[str, Any]:
  if not isinstance(body, dict):
    raise bad('the request body must be a JSON object')
  model = body.get('model')
  if not isinstance(model, str) or not model:
    raise bad("'model' is required: a non-empty string", 'model')
  n = body.get('n', 1)
  if n not in (1, None):
    raise bad(f"'n' must be 1 (one session is one trajectory): {n!r}", 'n')
  if not isinstance(body.get('stream', False), (bool, type(None))):
    raise bad("'stream' must be a boolean", 'stream')
  return body


def _text(content: Any, param: str) -> str:
  """A message's content as text: a string, null, or text parts."""
  if content is None:
    return ''
  if isinstance(content, str):
    return content
  if isinstance(content, list):
    out = []
    for part in content:
      if not (isinstance(part, dict) and part.get('type') == 'text'):
        raise bad('only text content parts are supported', param)
      if not isinstance(part.get('text'), str):
        raise bad("a text part needs a string 'text'", param)
      out.append(part['text'])
    return ''.join(out)
  raise bad('content must be a string, null or a list of text parts', param)


def _message(m: Any, i: int) -> dict[str, Any]:
  param = f'messages.[{i}]'
  if not isinstance(m, dict):
    raise bad('each message must be an object', param)
  role = m.get('role')
  if role not in ROLES:
    allowed = ', '.join(ROLES)
    raise bad(f'invalid role {role!r}; allowed: {allowed}', f'{param}.role')
  out = {'role': role, 'content': _text(m.get('content'), f'{param}.content')}
  if role == 'assistant' and m.get('tool_calls'):
    out['tool_calls'] = m['tool_calls']
  for key in ('tool_call_id', 'name'):
    if isinstance(m.get(key), str):
      out[key] = m[key]
  return out


def chat_request(body: Any) -> ChatRequest:
  body = _object(body)
  messages = body.get('messages')
  if not isinstance(messages, list) or not messages:
    raise bad("'messages' must be a non-empty list", 'messages')
  tools = body.get('tools') or []
  if not isinstance(tools, list) or not all(
    isinstance(t, dict) and isinstance(t.get('function'), dict) for t in tools
  ):
    raise bad("'tools' must be a list of {'type': 'function', ...}", 'tools')
  return ChatRequest(
    [_message(m, i) for i, m in enumerate(messages)],
    tools,
    bool(body.get('stream')),
  )


def completion_request(body: Any) -> CompletionRequest:
  body = _object(body)
  prompt = body.get('prompt')
  if isinstance(prompt, list) and len(prompt) == 1:
    prompt = prompt[0]
  if not isinstance(prompt, str):
    raise bad("'prompt' must be one string", 'prompt')
  return CompletionRequest(prompt, bool(body.get('stream')))


def split_calls(text: str, fmt: ToolCallFormat) -> tuple[str, list[ToolCall]]:
  """The text outside the call tags, and the calls; a malformed call is
  left in the text (the agent reads what was written)."""
  try:
    calls = parse_tool_calls(text, fmt)
  except MalformedToolCall:
    return text, []
  if not calls:
    return text, []
  rest, pos = [], 0
  while (i := text.find(fmt.start, pos)) >= 0:
    rest.append(text[pos:i])
    pos = text.find(fmt.end, i + len(fmt.start)) + len(fmt.end)
  rest.append(text[pos:])
  return ''.join(rest).strip(), calls


def openai_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
  out = []
  for call in calls:
    arguments = call.arguments if call.text is None else call.text
    out.append(
      {
        'id': f'call_{uuid.uuid4().hex[:24]}',
        'type': 'function',
        'function': {
          'name': call.name,
          'arguments': arguments
          if isinstance(arguments, str)
          else json.dumps(arguments),
        },
      }
    )
  return out


def _envelope(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
  return {
    'id': f'{"chatcmpl" if kind == "chat.completion" else "cmpl"}-'
    f'{uuid.uuid4().hex}',
    'object': kind,
    'created': int(time.time()),
    'model': MODEL,
    'choices': [choice],
    'usage': None,
  }


def chat_reply(
  text: str, fmt: ToolCallFormat, finish: str = 'stop'
) -> tuple[dict[str, Any], str | None]:
  """(the reply, the assistant content the agent will echo back)."""
  content, calls = split_calls(text, fmt)
  message: dict[str, Any] = {'role': 'assistant', 'content': content or None}
  if calls:
    message['tool_calls'] = openai_calls(calls)
    finish = 'tool_calls' if finish == 'stop' else finish
  choice = {
    'index': 0,
    'message': message,
    'finish_reason': finish,
    'logprobs': None,
  }
  return _envelope('chat.completion', choice), message['content']


def completion_reply(text: str, finish: str = 'stop') -> dict[str, Any]:
  choice = {'index': 0, 'text': text, 'finish_reason': finish, 'logprobs': None}
  return _envelope('text_completion', choice)


def stream_events(reply: dict[str, Any]) -> list[str]:
  """A finished reply as server-sent events: one chunk with the whole
  turn (the engine decodes the turn before it is sent), then [DONE]."""
  choice = dict(reply['choices'][0])
  if reply['object'] == 'chat.completion':
    choice['delta'] = choice.pop('message')
    kind = 'chat.completion.chunk'
  else:
    kind = 'text_completion'
  chunk = dict(reply, object=kind, choices=[choice])
  return [f'data: {json.dumps(chunk)}\n\n', 'data: [DONE]\n\n']
