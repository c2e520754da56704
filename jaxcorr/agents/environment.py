"""The environment API: what an agent acts in, in a few lines of user code.

    env = spec.make(session)           one fresh environment per trajectory;
                                       session.run(call) runs a tool call
                                       (contained, counted for this
                                       trajectory), session.tokenizer is
                                       the trainer's (for id observations)
    messages = env.reset(row)          the opening messages (system, user)
    result = env.step(action_text)     after each agent turn
      result.observation               new messages (rendered with the chat
                                       template's delta) or token ids
                                       (appended verbatim)
      result.reward                    this turn's reward (optional; 0.0)
      result.done                      the trajectory ends here
      result.info                      counts for the metrics (numbers)

The outcome reward is not the environment's job: the trainer's reward
functions (`config.reward.functions`, contained by `RewardScorer`) score
the final agent turn's text against the row's answer, and a trajectory's
reward is that plus the sum of its turn rewards (docs/agents.md).

`ToolEnvironment` is the common case: each agent turn either calls tools
(`jaxcorr.agents.tool_calls` format; the results come back as `tool`
messages) or answers (no call: done). A malformed call is an error
observation. What an environment does wrong (raises, returns a NaN
reward or ids outside the vocabulary) ends its trajectory, counted; too
many in a batch stop the run (`jaxcorr.agents.failures`). Environments
are registered by name
(`@register_environment('name')`, a builder of an `EnvironmentSpec` from
the `agent` config), like reward functions.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from jaxcorr.agents.calculator import calculator_tool
from jaxcorr.agents.tool_calls import (
  MalformedToolCall,
  ToolCall,
  ToolCallFormat,
  parse_tool_calls,
)
from jaxcorr.agents.tool_runner import ToolRunner, ToolSession
from jaxcorr.agents.tools import Tool
from jaxcorr.data.tasks import Example

Message = dict[str, Any]


@dataclasses.dataclass
class StepResult:
  """What `Environment.step` returns (module docstring)."""

  observation: list[Message] | list[int]
  reward: float = 0.0
  done: bool = False
  info: dict[str, float] = dataclasses.field(default_factory=dict)


class Environment(Protocol):
  def reset(self, row: Example) -> list[Message]:
    """The opening messages for dataset row `row`."""
    ...

  def step(self, action: str) -> StepResult:
    """The environment's answer to the agent's turn `action` (its decoded
    text; the trajectory keeps the sampled ids)."""
    ...


Expert = Callable[[Example, Sequence[Message]], 'str | None']
"""A scripted agent for demonstrations: `expert(row, messages)` is the
next agent turn's text given the conversation so far (the opening
messages, then each turn's observation), or None when it is done
(jaxcorr/agents/demonstrations.py)."""


@dataclasses.dataclass(frozen=True)
class EnvironmentSpec:
  """A registered environment: its tools, their call format, a factory
  of fresh environments (each given its trajectory's `ToolSession`: the
  tools, `run(call)`, the tokenizer) and, optionally, an `Expert` whose
  play-through is the SFT warm-up's data (`train.sft_steps` with
  agents)."""

  tools: tuple[Tool, ...]
  call_format: ToolCallFormat
  make: Callable[[ToolSession], Environment]
  expert: Expert | None = None


class ToolEnvironment:
  """Tool calls in, tool results out; a turn without a call is the answer.

  Args:
    runner: runs the calls (a `ToolSession`, or a `ToolRunner`).
    call_format: where calls are in the agent's text.
    system: an optional system message (e.g. `tool_system_prompt`).
    terse_errors: every error observation reads '?' (vocabularies without
      letters, configs/arith_tool.py); the outcome is still counted.
    content: the user message, the row's prompt replacing '{prompt}'.
  """

  def __init__(
    self,
    runner: ToolSession | ToolRunner,
    call_format: ToolCallFormat,
    system: str | None = None,
    terse_errors: bool = False,
    content: str = '{prompt}',
  ):
    self.runner, self.call_format, self.system = runner, call_format, system
    self.terse_errors, self.content = terse_errors, content

  def reset(self, row: Example) -> list[Message]:
    messages = []
    if self.system is not None:
      messages.append(self._message('system', self.system))
    user = self.content.replace('{prompt}', row.prompt)
    messages.append(self._message('user', user))
    return messages

  def step(self, action: str) -> StepResult:
    try:
      calls = parse_tool_calls(action, self.call_format)
    except MalformedToolCall as err:
      return StepResult(
        [self._message('tool', self._error(f'error: {err}'))],
        info={'malformed_calls': 1},
      )
    if not calls:
      return StepResult([], done=True)
    out = []
    for call in calls:
      content, outcome = self.runner.run(call)
      if outcome != 'ok':
        content = self._error(content)
      out.append(self._message('tool', content))
    return StepResult(out)

  def _error(self, text: str) -> str:
    return '?' if self.terse_errors else text

  @staticmethod
  def _message(role: str, content: str) -> Message:
    return {'role': role, 'content': content}


def tool_system_prompt(
  tools: Sequence[Tool], call_format: ToolCallFormat, example: ToolCall
) -> str:
  """A system message that lists the tools' schemas and the call format,
  with `example` written in it (for chat templates without a `tools`
  section)."""
  example = call_format.render(example)
  schemas = '\n'.join(json.dumps(t.schema()) for t in tools)
  return (
    'You may call these tools:\n'
    f'{schemas}\n'
    f'To call one, write {example}; its result comes back in a tool '
    'message. When you know the answer, reply with the answer only.'
  )


ENVIRONMENTS: dict[str, Callable[[Any], EnvironmentSpec]] = {}


def register_environment(name: str):
  """Decorator: `builder(agent_config) -> EnvironmentSpec` under `name`."""

  def wrap(builder):
    if name in ENVIRONMENTS:
      raise ValueError(f'environment {name!r} is already registered')
    ENVIRONMENTS[name] = builder
    return builder

  return wrap


def environment_spec(name: str, cfg: Any) -> EnvironmentSpec:
  """The spec of environment `name`; ValueError naming the known ones."""
  if name not in ENVIRONMENTS:
    known = ', '.join(sorted(ENVIRONMENTS))
    raise ValueError(
      f'config.agent.environment: invalid value {name!r}; allowed: '
      f"'' (off) or a registered environment: {known}"
    )
  return ENVIRONMENTS[name](cfg)


@register_environment('calculator')
def calculator_environment(cfg: Any) -> EnvironmentSpec:
  """Arithmetic with a calculator tool; the call format, error style and
  messages from `config.agent` (`call_start`, `call_end`, `call_body`,
  `terse_errors`, `system_prompt`, `user_content`)."""
  tools = (calculator_tool(),)
  fmt = ToolCallFormat(
    start=cfg.call_start,
    end=cfg.call_end,
    body=cfg.call_body,
    default_tool='calculator' if cfg.call_body == 'text' else '',
  )
  example = ToolCall('calculator', {'expression': '123*456'})
  system = (
    tool_system_prompt(tools, fmt, example) if cfg.system_prompt else None
  )
  return EnvironmentSpec(
    tools,
    fmt,
    lambda runner: ToolEnvironment(
      runner, fmt, system, cfg.terse_errors, cfg.user_content
    ),
    expert=functools.partial(_calculator_expert, fmt),
  )


def _calculator_expert(
  fmt: ToolCallFormat, row: Example, messages: Sequence[Message]
) -> str:
  """Call the calculator on the row's expression ('17*25=' -> '17*25'),
  then answer with what it returned (the environment ends the episode on
  a turn without a call)."""
  results = [m['content'] for m in messages if m['role'] == 'tool']
  if not results:
    expression = row.prompt.strip().rstrip('=?').strip()
    return fmt.render(ToolCall('calculator', {'expression': expression}))
  return results[-1]
