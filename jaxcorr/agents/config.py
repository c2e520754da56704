"""The trainer's `agent` section: multi-turn tool-use rollouts
(docs/agents.md). Off by default (`environment=''`): the trainer samples
single-turn completions as before."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxcorr.agents.tool_calls import ToolCall
from jaxcorr.config.fields import (
  boolean,
  fail,
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
  max_env_error_fraction: float = setting(
    0.5,
    number(0, 1),
    'An environment failure (make, reset or step raising, a non-finite '
    'turn reward, observation ids outside the vocabulary) ends its '
    'trajectory as an ABORT row, counted in agent/env_errors; more than '
    'this fraction of a batch (or of a warm-up batch of demonstrations) '
    'stops the run naming the environment and its first failure '
    '(jaxcorr/agents/failures.py). 1: never stop.',
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


def check_call_format(cfg: AgentConfig, spec: Any, tokenizer: Any) -> None:
  """Config time: the tokenizer can write a tool call of the environment's
  format (`spec.call_format`, built from `call_start`, `call_end` and
  `call_body`): a character it cannot encode would fail the warm-up's
  demonstrations and could never be sampled (the character vocabulary
  of configs/arith_tool.py has no braces, quotes or most letters).
  ValueError naming the field and what it allows."""
  fmt = spec.call_format
  for field, tag in (('call_start', fmt.start), ('call_end', fmt.end)):
    if bad := _unwritable(tokenizer, tag):
      fail(
        f'config.agent.{field}',
        tag,
        f'a tag of characters the tokenizer writes ({_alphabet(tokenizer)})',
        f'the tokenizer cannot write {bad}',
      )
  if fmt.body != 'json':
    return
  name = spec.tools[0].name if spec.tools else 'tool'
  example = fmt.render(ToolCall(name, {'x': '1'}))
  if bad := _unwritable(tokenizer, example):
    fail(
      'config.agent.call_body',
      'json',
      "'text' (the text between call_start and call_end is the tool's one "
      "argument, e.g. call_start='(' call_end=')'), or a vocabulary that "
      "writes JSON (config.data.tokenizer='bytes')",
      f'the tokenizer cannot write {bad} of a JSON call like {example}',
    )


def _writes(tokenizer: Any, char: str) -> bool:
  try:
    return tokenizer.decode(tokenizer.encode(char, bos=False)) == char
  except Exception:  # a tokenizer refuses what it cannot encode
    return False


def _unwritable(tokenizer: Any, text: str) -> str:
  """The characters of `text` the tokenizer cannot write, as one text."""
  return ' '.join(
    repr(c) for c in sorted(set(text)) if not _writes(tokenizer, c)
  )


def _alphabet(tokenizer: Any) -> str:
  chars = getattr(tokenizer, 'characters', None)
  return repr(chars) if chars else 'see its vocabulary'
