"""The trainer's `agent` section: multi-turn tool-use rollouts
(docs/agents.md). Off by default (`environment=''`): the trainer samples
single-turn completions as before."""

from __future__ import annotations

import dataclasses

from jaxcorr.config.fields import (
  boolean,
  integer,
  number,
  one_of,
  path_of,
  setting,
  text,
  validate,
)


@dataclasses.dataclass(frozen=True)
class AgentConfig:
  """Environment, budgets and tool settings of multi-turn rollouts."""

  environment: str = setting(
    '',
    text,
    "A registered environment (jaxcorr.agents.environment: 'calculator'); "
    "'' = off (single-turn rollouts).",
  )
  chat_template: str = setting(
    'model',
    one_of('model', 'arith'),
    "The chat template of the turns: 'model' (the HF checkpoint's own) or "
    "'arith' (jaxcorr.agents.turns.ARITH_TOOL_TEMPLATE, the character "
    'vocabulary).',
  )
  max_turns: int = setting(4, integer(1), 'Most agent turns per trajectory.')
  turn_tokens: int = setting(64, integer(1), 'Most tokens of one agent turn.')
  max_env_tokens: int = setting(
    64,
    integer(1),
    'Most tokens of one environment turn (the template delta of its '
    'messages); a longer observation ends the trajectory as truncated. '
    "Sets the engine's cache headroom for continuations.",
  )
  drop_truncated: bool = setting(
    False,
    boolean,
    'Trajectories that hit a budget (rollout.max_new_tokens after the '
    'prompt, max_turns) train nothing: their agent tokens leave the loss.',
  )
  kv_reuse: bool = setting(
    True,
    boolean,
    "Continue a trajectory on its slot's KV cache (False: re-prefill the "
    'whole history each turn; slower, the same tokens).',
  )
  tool_timeout_s: float = setting(
    5.0, number(0), 'Seconds per tool call (agent/tool_timeout counts them).'
  )
  env_workers: int = setting(
    4, integer(1), 'Host threads that step environments and run tools.'
  )
  call_start: str = setting('<tool_call>', text, 'Opening tag of a call.')
  call_end: str = setting('</tool_call>', text, 'Closing tag of a call.')
  call_body: str = setting(
    'json',
    one_of('json', 'text'),
    '\'json\': {"name": ..., "arguments": {...}} (Hermes); \'text\': the '
    "body is the tool's one argument (jaxcorr.agents.tool_calls).",
  )
  terse_errors: bool = setting(
    False,
    boolean,
    "Tool and call errors read '?' (a vocabulary without letters); the "
    'outcome is still counted.',
  )
  user_content: str = setting(
    '{prompt}',
    text,
    "The opening user message, with the row's prompt as {prompt} "
    "(e.g. 'What is {prompt}').",
  )
  system_prompt: bool = setting(
    True,
    boolean,
    'Open with a system message listing the tools and the call format.',
  )

  def __post_init__(self):
    validate(self)
    if self.user_content.count('{prompt}') != 1:
      raise ValueError(
        f'{path_of(self)}.user_content: invalid value {self.user_content!r}; '
        "allowed: a text holding '{prompt}' once"
      )
    if self.tool_timeout_s <= 0:
      raise ValueError(
        f'{path_of(self)}.tool_timeout_s: invalid value '
        f'{self.tool_timeout_s}; '
        'allowed: > 0'
      )

  @property
  def enabled(self) -> bool:
    return bool(self.environment)
