"""The reward registry: `@register('name')`, the built-in rewards, and the
`config.reward.functions` spec ('math_answer:1.0,format:0.1')."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import NamedTuple

from jaxcorr.rewards.answers import (
  BOXED,
  FINAL_NUMBER,
  answers_match,
  extract_answer,
  last_boxed,
)

RewardFn = Callable[[str, str], float]


class Outcome(NamedTuple):
  """A reward value with the reason for it ('passed', 'timeout', ...): a
  reward may return one instead of a float, and the scorer counts each
  reason per step in `reward/<name>/outcome/<reason>`."""

  value: float
  reason: str


REWARDS: dict[str, RewardFn] = {}

_SPEC = 'config.reward.functions'
_NAME = re.compile(r'[A-Za-z_][A-Za-z0-9_.\-]*')


def register(
  name: str, *, override: bool = False
) -> Callable[[RewardFn], RewardFn]:
  """Decorator: `@register('my_reward')` adds `fn(response, answer) -> float`
  to `REWARDS` under `name` (a name taken already is an error unless
  `override=True`). Functions may run on worker threads: keep them
  thread-safe."""
  if not isinstance(name, str) or not _NAME.fullmatch(name):
    raise ValueError(
      f'reward name {name!r}: allowed: letters, digits, _ . - (not starting '
      'with a digit, no : or , which separate the config.reward.functions '
      'spec)'
    )

  def deco(fn: RewardFn) -> RewardFn:
    if not callable(fn):
      raise ValueError(f'reward {name!r}: {fn!r} is not callable')
    if name in REWARDS and not override and REWARDS[name] is not fn:
      raise ValueError(
        f'reward {name!r} is registered already ({REWARDS[name]!r}); pass '
        'override=True to replace it'
      )
    REWARDS[name] = fn
    return fn

  return deco


# -- built-in rewards --------------------------------------------------------


@register('exact_match')
def exact_match(response: str, answer: str) -> float:
  """1 when the stripped response equals the stripped answer."""
  return float(response.strip() == answer.strip())


# The embedded task's reward: the model must answer with exactly the number
# and stop ('42', not '42 ' followed by more tokens, nor '042'). That is
# exact_match; the separate name keeps arithmetic configs self-describing.
register('arith_exact')(exact_match)


@register('math_answer')
def math_answer(response: str, answer: str) -> float:
  """1 when the response's final answer (`extract_answer`) matches the
  reference (`answers_match`). A reference that is a whole solution
  ('... #### 72', '... \\boxed{3}') is reduced to its final answer too."""
  predicted = extract_answer(response)
  if predicted is None:
    return 0.0
  reference = answer.strip()
  if '####' in reference or BOXED.search(reference):
    reference = extract_answer(reference) or reference
  return float(answers_match(predicted, reference))


@register('format')
def format_reward(response: str, answer: str) -> float:
  """1 when the response marks a final answer: '####' followed by a number,
  or a non-empty `\\boxed{...}`."""
  del answer
  if FINAL_NUMBER.search(response):
    return 1.0
  return float(bool(last_boxed(response)))


# -- the spec ----------------------------------------------------------------


def parse_spec(text: str) -> list[tuple[str, float]]:
  """'math_answer:1.0,format:0.1' -> [('math_answer', 1.0), ('format', 0.1)];
  a name without ':weight' has weight 1.0."""
  if not isinstance(text, str) or not text.strip():
    raise ValueError(
      f"{_SPEC}: invalid value {text!r}; allowed: 'name[:weight],...', e.g. "
      "'math_answer:1.0,format:0.1'"
    )
  spec = []
  for item in text.split(','):
    name, sep, weight_text = item.partition(':')
    name = name.strip()
    if not _NAME.fullmatch(name):
      raise ValueError(
        f'{_SPEC}: invalid entry {item.strip()!r} in {text!r}; allowed: '
        "'name' or 'name:weight', entries separated by ','"
      )
    weight = 1.0
    if sep:
      try:
        weight = float(weight_text)
      except ValueError:
        weight = math.nan
      if not math.isfinite(weight):
        raise ValueError(
          f'{_SPEC}: invalid weight {weight_text.strip()!r} for {name!r} in '
          f'{text!r}; allowed: a finite number'
        )
    spec.append((name, weight))
  return spec
