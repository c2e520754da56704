"""An agent program that speaks the OpenAI API, as a trainer environment.

    register_agent('my_agent', agent)    environment 'my_agent':
                                          --config.agent.environment=my_agent

`agent(call: AgentCall) -> float | None` is any program that talks to
`call.base_url` with `call.api_key` (e.g. `call.client()`, an `openai.OpenAI`
client): one call per dataset row and sample, on a thread of its own. The
trajectory is built inverted: the agent drives, the engine answers.

    reset(row)    start the agent; its first call's messages are the prompt
                  (chat template, `tools` listed in a system message) or
                  its prompt text (completions), encoded once
    step(text)    answer the open call with the sampled turn (tool calls in
                  the text become OpenAI `tool_calls`), then take the next
                  call: its messages after the echoed assistant turn are
                  the observation (the chat template's delta; completions:
                  the text after the previous prompt and reply), or the
                  agent's end: done, its return value a turn reward
    finish(tr)    the session's record: each call's ids, μ and versions

Token-in, token-out: a call must extend the session's conversation (the
same earlier messages, the assistant turn as it was answered, then new
messages); the earlier turns are never re-rendered or re-encoded, so the
trajectory's ids are the sampled ones and the agent mask is exact. A call
that does not extend it gets a 400 and ends the trajectory. An agent that
raises, or sends nothing for `agent_timeout_s`, ends its trajectory as an
environment failure (an ABORT row: jaxcorr/agents/failures.py), never the
run; its thread is abandoned and its later calls get 409.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import threading
from collections.abc import Callable
from typing import Any

from jaxcorr.agents.environment import (
  ENVIRONMENTS,
  EnvironmentSpec,
  StepResult,
  register_environment,
)
from jaxcorr.agents.failures import describe
from jaxcorr.agents.tool_calls import ToolCallFormat
from jaxcorr.config.fields import integer, number, setting, text, validate
from jaxcorr.data.tasks import Example
from jaxcorr.endpoint.protocol import (
  MODEL,
  ApiError,
  bad,
  chat_reply,
  completion_reply,
)
from jaxcorr.endpoint.server import EndpointServer, shared_server
from jaxcorr.endpoint.sessions import (
  Call,
  CallRecord,
  Ended,
  Raised,
  SessionRecord,
)


@dataclasses.dataclass(frozen=True)
class EndpointSettings:
  """Where the endpoint listens and how long an agent may take."""

  host: str = setting('127.0.0.1', text, 'Address the endpoint binds.')
  port: int = setting(0, integer(0), 'Its port (0: a free one).')
  agent_timeout_s: float = setting(
    60.0,
    number(0),
    "Seconds the trainer waits for an agent's next call or its end; "
    'longer ends the trajectory as an environment failure.',
  )

  def __post_init__(self):
    validate(self)


@dataclasses.dataclass(frozen=True)
class AgentCall:
  """What an agent program is given: where to call, as which session,
  and the dataset row it plays."""

  base_url: str
  api_key: str
  row: Example
  model: str = MODEL

  def client(self, **kwargs):
    """An `openai.OpenAI` client on this session (no retries: a retried
    call would be a second turn), over the process's one HTTP connection
    pool (`http_client()`). A reply may wait for the trainer (a compile,
    an update while a stream holds its rollouts), so keep time-outs in
    minutes (openai's default: 10)."""
    import openai

    kwargs.setdefault('max_retries', 0)
    kwargs.setdefault('http_client', http_client())
    return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)


_HTTP: list = []
_HTTP_LOCK = threading.Lock()


def http_client():
  """One `httpx.Client` for every agent of the process: making one builds
  an SSL context (70-290 ms on the 2-core CPU, more than a whole turn of a
  small model), and a client is thread-safe."""
  with _HTTP_LOCK:
    if not _HTTP:
      import httpx

      limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
      _HTTP.append(httpx.Client(limits=limits, timeout=None))
    return _HTTP[0]


Agent = Callable[[AgentCall], Any]


def _tools_message(tools: list[dict[str, Any]], fmt: ToolCallFormat) -> dict:
  """A system message listing the request's tools and the call format
  the turn's text must use for them to come back as `tool_calls`."""
  schemas = '\n'.join(json.dumps(t) for t in tools)
  example = f'{fmt.start}{{"name": ..., "arguments": {{...}}}}{fmt.end}'
  return {
    'role': 'system',
    'content': f'You may call these tools:\n{schemas}\nTo call one, write '
    f'{example}; its result comes back in a tool message.',
  }


class AgentEnvironment:
  """One trajectory of an agent program (module docstring)."""

  def __init__(
    self,
    server: EndpointServer,
    agent: Agent,
    settings: EndpointSettings,
    fmt: ToolCallFormat,
    tokenizer: Any,
  ):
    self.server, self.agent, self.settings = server, agent, settings
    self.fmt, self.tokenizer = fmt, tokenizer
    self.session = None
    self.kind = ''
    self.messages: list[dict[str, Any]] = []  # the conversation so far
    self.text = ''  # completions: the prompt text so far
    self.answered: str | None = None  # the last reply's content

  # ------------------------------------------------------------ the API

  def reset(self, row: Example):
    self.session = self.server.hub.open()
    call = AgentCall(
      self.server.base_url(self.session.id), self.session.id, row
    )
    threading.Thread(
      target=self._play, args=(call,), name='agent', daemon=True
    ).start()
    try:
      first = self._take()
      if not isinstance(first, Call):
        raise RuntimeError('the agent ended before its first call')
      self.kind = first.kind
      if first.kind == 'completion':
        self.text = first.request.prompt
        return list(self.tokenizer.encode(self.text, bos=True))
      self.messages = list(first.request.messages)
      if first.request.tools:
        return [_tools_message(first.request.tools, self.fmt), *self.messages]
      return self.messages
    except BaseException:
      self.close()
      raise

  def step(self, action: str) -> StepResult:
    if self.kind == 'chat':
      reply, self.answered = chat_reply(action, self.fmt)
      self.messages.append({'role': 'assistant', 'content': action})
    else:
      reply = completion_reply(action)
      self.text += action
    self.session.answer(200, reply)
    nxt = self._take()
    if isinstance(nxt, Ended):
      return StepResult([], reward=_reward(nxt.result), done=True)
    try:
      if nxt.kind != self.kind:
        raise bad(f'a {self.kind} session cannot continue with a {nxt.kind}')
      if nxt.kind == 'completion':
        return StepResult(self._text_delta(nxt.request.prompt))
      return StepResult(self._message_delta(nxt.request.messages))
    except ApiError as err:
      self.session.answer(err.status, err.body())
      raise

  def finish(self, trajectory: Any) -> None:
    """The trajectory is over: record it under the session, end the
    session (called by `AgentRollouts.collect`)."""
    if self.session is None:
      return
    record = SessionRecord(self.session.id, trajectory=trajectory)
    record.error = trajectory.error
    prompt = len(trajectory.prompt)
    for start, end in trajectory.turn_spans:
      record.calls.append(_call_record(trajectory, prompt, start, end))
    self.server.hub.keep_record(record)
    self.close()

  # ------------------------------------------------------------ parts

  def _play(self, call: AgentCall) -> None:
    try:
      result = self.agent(call)
    except BaseException as err:  # the agent's failure: its row's
      self.session.end(Raised(describe('agent', err)))
    else:
      self.session.end(Ended(result))

  def _take(self):
    item = self.session.take(self.settings.agent_timeout_s)
    if isinstance(item, Raised):
      raise RuntimeError(item.error)
    return item

  def _message_delta(self, messages: list[dict[str, Any]]) -> list[dict]:
    n = len(self.messages)
    extends = (
      len(messages) > n
      and [m['role'] for m in messages[:n]]
      == [m['role'] for m in self.messages]
      and all(
        a['content'] == b['content']
        for a, b in zip(messages[: n - 1], self.messages[: n - 1])
        if a['role'] != 'assistant'
      )
      and _same(messages[n - 1]['content'], self.answered)
    )
    if not extends:
      raise bad(
        'not a continuation of this session: send its messages so far, '
        'the assistant reply as it was returned, then new messages',
        'messages',
        'not_a_continuation',
      )
    self.messages = [*self.messages[: n - 1], *messages[n - 1 :]]
    return list(messages[n:])

  def _text_delta(self, prompt: str) -> list[int]:
    if not prompt.startswith(self.text) or len(prompt) == len(self.text):
      raise bad(
        'not a continuation of this session: the prompt must be the '
        'previous prompt and completion, then new text',
        'prompt',
        'not_a_continuation',
      )
    new, self.text = prompt[len(self.text) :], prompt
    return list(self.tokenizer.encode(new, bos=False))

  def close(self) -> None:
    """End the session (no record): its open call gets an empty turn."""

    def empty(call: Call) -> dict[str, Any]:
      if call.kind == 'chat':
        return chat_reply('', self.fmt, 'length')[0]
      return completion_reply('', 'length')

    self.session.close(empty)


def _same(echoed: str | None, answered: str | None) -> bool:
  """The echoed assistant content is the reply's, up to surrounding
  whitespace (clients strip it; the trajectory keeps the sampled ids)."""
  return (echoed or '').strip() == (answered or '').strip()


def _reward(result: Any) -> float:
  if result is None:
    return 0.0
  if isinstance(result, numbers.Real) and not isinstance(result, bool):
    return float(result)
  raise TypeError(
    f'the agent returned {type(result).__name__}: a number (its reward) or None'
  )


def _call_record(tr: Any, prompt: int, start: int, end: int) -> CallRecord:
  return CallRecord(
    context=prompt + start,
    ids=list(tr.tokens[start:end]),
    logp=list(tr.logp[start:end]),
    versions=list(tr.versions[start:end]),
  )


_AGENTS: set[str] = set()


def register_agent(
  name: str, agent: Agent, settings: EndpointSettings | None = None
) -> None:
  """Environment `name` runs `agent` through the endpoint (module
  docstring); the call format is `config.agent`'s (call_start, call_end,
  call_body). Registering the same name again replaces the agent (a config
  module loaded twice); a name another environment holds is refused."""
  settings = settings or EndpointSettings()
  if name in ENVIRONMENTS and name not in _AGENTS:
    raise ValueError(f'environment {name!r} is already registered')

  def build(cfg: Any) -> EnvironmentSpec:
    fmt = ToolCallFormat(
      start=cfg.call_start, end=cfg.call_end, body=cfg.call_body
    )
    server = shared_server(settings.host, settings.port)
    return EnvironmentSpec(
      tools=(),
      call_format=fmt,
      make=lambda session: AgentEnvironment(
        server, agent, settings, fmt, session.tokenizer
      ),
    )

  ENVIRONMENTS.pop(name, None)
  register_environment(name)(build)
  _AGENTS.add(name)
