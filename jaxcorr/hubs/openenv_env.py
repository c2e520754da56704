"""OpenEnv environments (`openenv-core`) as trainer environments.

    register_openenv('name', 'http://127.0.0.1:8000')
    --config.agent.environment=name

An OpenEnv environment is a server (its `create_app`: HTTP and a WebSocket
session per client) that `reset`s and `step`s on actions, each observation
carrying `reward` and `done`. Each trajectory opens its own session
(`GenericEnvClient`, synchronous wrapper), so concurrent trajectories
never share an environment instance:

    reset(row)     the session's reset(**reset_kwargs(row)); its observation,
                   rendered as text, is the opening user message
    step(text)     the agent's turn as an action: a JSON object is the
                   action; for an action schema with one required field,
                   the turn's text fills it. A turn that is neither gets an
                   error message back (counted in agent/malformed_calls).
                   The observation's reward is the turn reward; `done`
                   ends the trajectory; otherwise the rendered observation
                   is the next message (`role`)
    finish(tr)     the session is closed

The action schema comes from the server's `/schema` once, when the
environment is built. OpenEnv's rewards are per step, so the trajectory's
reward is their sum (plus the trainer's `reward.functions` on the last
turn: set `exact_match:0` for the environment's rewards alone). A server
that fails (refused connection, a step raising, a time-out) ends that
trajectory (jaxcorr/agents/failures.py).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import Any

import httpx

from jaxcorr.agents.environment import (
  EnvironmentSpec,
  StepResult,
  register_environment,
)
from jaxcorr.agents.tool_calls import ToolCallFormat
from jaxcorr.data.tasks import Example

_ENVELOPE = ('done', 'reward', 'metadata')


def render_observation(observation: dict[str, Any]) -> str:
  """An observation as text: its one text field, or its fields as JSON
  (without done, reward and metadata)."""
  fields = {k: v for k, v in observation.items() if k not in _ENVELOPE}
  texts = [v for v in fields.values() if isinstance(v, str)]
  if len(fields) == 1 and len(texts) == 1:
    return texts[0]
  return json.dumps(fields, ensure_ascii=False)


def seed_of(row: Example) -> dict[str, Any]:
  """The default reset arguments: a seed from the row's prompt, so a row
  is the same episode every time it is drawn."""
  return {'seed': zlib.crc32(row.prompt.encode())}


def action_of(text: str, schema: dict[str, Any]) -> dict[str, Any] | None:
  """The agent's turn as an action (module docstring); None if it is
  neither a JSON object nor text for a one-field action."""
  text = text.strip()
  try:
    value = json.loads(text)
  except ValueError:
    value = None
  if isinstance(value, dict):
    return value
  required = schema.get('required', [])
  if len(required) == 1:
    return {required[0]: text}
  return None


class OpenEnvEnvironment:
  """One trajectory: one OpenEnv session (module docstring)."""

  def __init__(
    self,
    base_url: str,
    schema: dict[str, Any],
    reset_kwargs: Callable[[Example], dict[str, Any]],
    role: str,
    timeout_s: float,
  ):
    self.base_url, self.schema = base_url, schema
    self.reset_kwargs, self.role, self.timeout_s = reset_kwargs, role, timeout_s
    self.client = None

  def reset(self, row: Example) -> list[dict[str, Any]]:
    from openenv import GenericEnvClient

    self.client = GenericEnvClient(
      base_url=self.base_url,
      connect_timeout_s=self.timeout_s,
      message_timeout_s=self.timeout_s,
    ).sync()
    result = self.client.reset(**self.reset_kwargs(row))
    return [{'role': 'user', 'content': render_observation(result.observation)}]

  def step(self, action: str) -> StepResult:
    act = action_of(action, self.schema)
    if act is None:
      fields = ', '.join(self.schema.get('required', []))
      error = f'error: write the action as a JSON object with {fields}'
      return StepResult(
        [{'role': self.role, 'content': error}], info={'malformed_calls': 1}
      )
    result = self.client.step(act)
    reward = float(result.reward or 0.0)
    if result.done:
      self.finish(None)
      return StepResult([], reward=reward, done=True)
    content = render_observation(result.observation)
    return StepResult([{'role': self.role, 'content': content}], reward=reward)

  def finish(self, trajectory: Any) -> None:
    client, self.client = self.client, None
    if client is not None:
      client.close()


def register_openenv(
  name: str,
  base_url: str,
  *,
  reset_kwargs: Callable[[Example], dict[str, Any]] = seed_of,
  role: str = 'user',
  timeout_s: float = 30.0,
) -> None:
  """Environment `name`: the OpenEnv server at `base_url` (module
  docstring); `role` is the role of the observations after the first."""

  def build(cfg: Any) -> EnvironmentSpec:
    try:
      reply = httpx.get(f'{base_url}/schema', timeout=timeout_s)
      reply.raise_for_status()
      schema = reply.json()['action']
    except (httpx.HTTPError, ValueError, KeyError) as err:
      raise ValueError(
        f'config.agent.environment: {name!r}: no OpenEnv action schema at '
        f'{base_url}/schema ({type(err).__name__}: {err})'
      ) from None
    return EnvironmentSpec(
      tools=(),
      call_format=ToolCallFormat(),
      make=lambda session: OpenEnvEnvironment(
        base_url, schema, reset_kwargs, role, timeout_s
      ),
    )

  register_environment(name)(build)
