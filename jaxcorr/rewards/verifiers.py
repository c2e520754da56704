"""Rewards that delegate to third-party verifiers (optional extras).

* `math_verify`: HF's `math-verify` parses the reply and the reference
  into sympy objects and compares them (LaTeX, fractions, sets, intervals,
  `1,000`): `pip install jaxcorr[math]`.
* `reasoning_gym`: the task's own `score_answer` for rows of
  `config.data.source='reasoning_gym'` (`jaxcorr.data.reasoning_gym`):
  `pip install jaxcorr[reasoning_gym]`.

Both are registered whenever `jaxcorr.rewards` is imported; their packages
are imported on the first call, so the trainer does not pay for sympy
unless a config names them. `jaxcorr.train.build.check_components` runs
`check_installed` at start-up, so a missing extra is an error naming the
`pip install`, not a run of zero rewards.

Timeouts: math-verify bounds its own parsing and comparison with
`signal.alarm`, which works only on the main thread; reward calls run on
worker threads (or worker processes' call threads), where it raises. The
reward therefore passes `parsing_timeout=None` / `timeout_seconds=None`
and relies on the scorer's `config.reward.timeout_s` like any reward: the
call is abandoned (`isolation='thread'`: the thread runs on to the end of
its sympy work) or its process killed (`isolation='process'`, the choice
for sympy on untrusted replies; docs/data_and_rewards.md).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Iterable
from types import ModuleType

from jaxcorr.data import reasoning_gym as rg_data
from jaxcorr.rewards.registry import register

# The extra that provides each reward's package (setup.py extras_require).
EXTRAS = {
  'math_verify': ('math_verify', 'math'),
  'reasoning_gym': ('reasoning_gym', 'reasoning_gym'),
}


class _NoTimeoutWarning(logging.Filter):
  """Drops math-verify's 'Timeout is disabled' warning: the scorer's
  `timeout_s` is the timeout here (module doc)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith('Timeout is disabled')


def _math_verify() -> ModuleType:
  module = importlib.import_module('math_verify')
  for name in ('math_verify.parser', 'math_verify.grader'):
    log = logging.getLogger(name)
    if not any(isinstance(f, _NoTimeoutWarning) for f in log.filters):
      log.addFilter(_NoTimeoutWarning())
  return module


def check_installed(names: Iterable[str]) -> None:
  """ValueError naming `config.reward.functions` and the `pip install`
  for each of `names` whose verifier package is missing."""
  for name in names:
    if name not in EXTRAS:
      continue
    package, extra = EXTRAS[name]
    if importlib.util.find_spec(package) is None:
      raise ValueError(
        f'config.reward.functions: reward {name!r} needs the {package!r} '
        f'package; install it with: pip install jaxcorr[{extra}]'
      )


def _gold(mv: ModuleType, answer: str) -> list:
  """The reference parsed by math-verify. A bare answer ('0.5', '2(x+1)',
  '2, -3', '(1,2]') is parsed as the content of `\\boxed{}`: math-verify's
  plain-expression extraction would keep one number of it ('2(x+1)' -> 2,
  '2, -3' -> -3). A reference with its own `$...$` or `\\boxed{}` (a whole
  solution) is parsed as written; a GSM8K one is reduced to the text after
  its last '####'."""
  text = answer.strip()
  if '####' in text:
    text = text.rsplit('####', 1)[1].strip()
  if not text:
    return []
  if '$' not in text and '\\boxed' not in text:
    gold = mv.parse(f'\\boxed{{{text}}}', parsing_timeout=None)
    if gold:
      return gold
  return mv.parse(text, parsing_timeout=None)


@register('math_verify')
def math_verify_reward(response: str, answer: str) -> float:
  """1 when math-verify finds the reply's final answer equal to the
  reference: `verify(parse(reference), parse(response))` with its default
  extraction (the last `\\boxed{}` first, then LaTeX in `$...$`, then plain
  expressions) and comparison (numbers to 6 decimals, symbolic equality,
  sets, intervals, matrices). 0 when either side parses to nothing."""
  mv = _math_verify()
  gold = _gold(mv, answer)
  if not gold:
    return 0.0
  predicted = mv.parse(response, parsing_timeout=None)
  if not predicted:
    return 0.0
  return float(mv.verify(gold, predicted, timeout_seconds=None))


@register('reasoning_gym')
def reasoning_gym_reward(response: str, answer: str) -> float:
  """The reasoning-gym task's own `score_answer(extracted, entry)`: the
  entry is regenerated from the row's reference key
  (`jaxcorr.data.reasoning_gym.entry`), the reply's answer is the text of
  its last `<answer>...</answer>` (reasoning-gym's `extract_answer`; None
  when there is none, which the tasks score 0)."""
  dataset, item = rg_data.entry(answer)
  extracted = rg_data.extract(response)
  return float(dataset.score_answer(extracted, item))
