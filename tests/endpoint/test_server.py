"""The endpoint without the engine: the test plays the engine (it calls
the environment's reset / step with turn texts) and the agents are real
`openai` clients over loopback. One server for the module."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from jaxcorr.agents.environment import StepResult
from jaxcorr.agents.tool_calls import ToolCallFormat
from jaxcorr.data.tasks import Example
from jaxcorr.data.text import ByteTokenizer
from jaxcorr.endpoint import AgentEnvironment, EndpointServer, EndpointSettings

ROW = Example(prompt='3+4=', answer='7')
TOK = ByteTokenizer()
FMT = ToolCallFormat()


@pytest.fixture(scope='module')
def server():
  s = EndpointServer()
  # openai builds its resources on first use (a second or more on a slow
  # CPU): once here, so the agents' time-outs time their calls only.
  client = openai.OpenAI(base_url=s.base_url('warm-up'), api_key='k')
  assert client.chat.completions and client.completions
  yield s
  s.close()


def _env(server, agent, timeout_s=10.0):
  settings = EndpointSettings(agent_timeout_s=timeout_s)
  return AgentEnvironment(server, agent, settings, FMT, TOK)


def _wait(items: list, seconds: float = 5.0) -> list:
  """`items` once an agent thread has put something in it."""
  deadline = time.monotonic() + seconds
  while not items and time.monotonic() < deadline:
    time.sleep(0.02)
  return items


def _error(response: httpx.Response, status: int) -> dict:
  assert response.status_code == status, response.text
  err = response.json()['error']
  assert set(err) == {'message', 'type', 'param', 'code'}
  assert err['message']
  return err


def test_malformed_requests_get_openai_errors_and_it_keeps_serving(server):
  replies = []

  def agent(call):
    base = call.base_url
    post = httpx.post
    chat = f'{base}/chat/completions'
    good = {'model': 'm', 'messages': [{'role': 'user', 'content': 'hi'}]}
    replies.extend([
      (post(chat, content=b'{not json'), 400, None),
      (post(chat, json=[1, 2]), 400, None),
      (post(chat, json={'messages': good['messages']}), 400, 'model'),
      (post(chat, json={'model': 'm'}), 400, 'messages'),
      (post(chat, json={**good, 'messages': [{'role': 'x'}]}), 400,
       'messages.[0].role'),
      (post(chat, json={**good, 'n': 2}), 400, 'n'),
      (post(chat, json={**good, 'messages': [
        {'role': 'user', 'content': [{'type': 'image_url'}]}]}), 400,
       'messages.[0].content'),
      (post(f'{base}/completions', json={'model': 'm', 'prompt': 3}), 400,
       'prompt'),
      (post(chat.replace(call.api_key, 'nobody'), json=good), 404, None),
      (post(base.split('/s/')[0] + '/v1/chat/completions', json=good), 401,
       None),
      (post(f'{base}/nowhere', json=good), 404, None),
      (httpx.get(chat), 405, None),
    ])  # fmt: skip
    client = call.client()
    reply = client.chat.completions.create(model='m', messages=good['messages'])
    return float(reply.choices[0].message.content == 'hello')

  env = _env(server, agent)
  assert env.reset(ROW) == [{'role': 'user', 'content': 'hi'}]
  assert env.step('hello') == StepResult([], reward=1.0, done=True)
  for response, status, param in replies:
    assert _error(response, status)['param'] == param


def test_turns_are_deltas_and_calls_are_openai_tool_calls(server):
  seen = {}
  tools = [{'type': 'function', 'function': {'name': 'add', 'parameters': {}}}]

  def agent(call):
    client = call.client()
    messages = [{'role': 'user', 'content': 'add 3 and 4'}]
    first = client.chat.completions.create(
      model='m', messages=messages, tools=tools
    )
    seen['first'] = first.choices[0]
    message = first.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    messages.append(
      {
        'role': 'tool',
        'tool_call_id': message.tool_calls[0].id,
        'content': '7',
      }
    )
    second = client.chat.completions.create(model='m', messages=messages)
    seen['second'] = second.choices[0].message.content
    return 0.5

  env = _env(server, agent)
  opening = env.reset(ROW)
  assert opening[0]['role'] == 'system' and '"add"' in opening[0]['content']
  assert opening[1:] == [{'role': 'user', 'content': 'add 3 and 4'}]
  call = (
    'ok <tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
  )
  result = env.step(call)
  # Only the new message: the earlier turns are never rendered again.
  assert result.observation == [
    {
      'role': 'tool',
      'content': '7',
      'tool_call_id': result.observation[0]['tool_call_id'],
    }
  ]
  choice = seen['first']
  assert choice.finish_reason == 'tool_calls'
  assert choice.message.content == 'ok'
  (tc,) = choice.message.tool_calls
  assert tc.function.name == 'add'
  assert json.loads(tc.function.arguments) == {'a': 3, 'b': 4}
  assert env.step('7') == StepResult([], reward=0.5, done=True)
  assert seen['second'] == '7'


def test_completions_continue_with_the_new_text_only(server):
  out = {}

  def agent(call):
    client = call.client()
    first = client.completions.create(model='m', prompt='Q: 3+4=?\nA:')
    text = 'Q: 3+4=?\nA:' + first.choices[0].text + '\n= lower\nA:'
    second = client.completions.create(model='m', prompt=text, stream=True)
    out['streamed'] = ''.join(c.choices[0].text for c in second)

  env = _env(server, agent)
  assert env.reset(ROW) == TOK.encode('Q: 3+4=?\nA:', bos=True)
  result = env.step(' 9')
  assert result.observation == TOK.encode('\n= lower\nA:', bos=False)
  assert env.step(' 7').done
  assert out['streamed'] == ' 7'


def test_a_rewritten_history_is_refused_and_ends_the_trajectory(server):
  errors = []

  def agent(call):
    client = call.client()
    messages = [{'role': 'user', 'content': 'a'}]
    client.chat.completions.create(model='m', messages=messages)
    messages += [
      {'role': 'assistant', 'content': 'something else'},
      {'role': 'user', 'content': 'b'},
    ]
    try:
      client.chat.completions.create(model='m', messages=messages)
    except openai.BadRequestError as err:
      errors.append(err.body)
      raise

  env = _env(server, agent)
  env.reset(ROW)
  with pytest.raises(Exception, match='not a continuation'):
    env.step('x')
  assert _wait(errors)[0]['code'] == 'not_a_continuation'


def test_an_agent_that_raises_or_hangs_fails_its_row_only(server):
  def raises(call):
    raise ValueError('agent bug')

  with pytest.raises(RuntimeError, match='agent: ValueError: agent bug'):
    _env(server, raises).reset(ROW)

  late = []

  def hangs(call):
    client = call.client()
    messages = [{'role': 'user', 'content': 'a'}]
    client.chat.completions.create(model='m', messages=messages)
    time.sleep(2.0)  # past the trainer's patience
    try:
      client.chat.completions.create(model='m', messages=messages)
    except openai.APIStatusError as err:
      late.append(err.status_code)

  env = _env(server, hangs, timeout_s=1.0)
  env.reset(ROW)
  with pytest.raises(TimeoutError, match='in 1 s'):
    env.step('x')
  env.close()  # as `finish` does after the failed trajectory
  # The session has ended, and the server still serves.
  assert _wait(late, 10.0) == [409]
