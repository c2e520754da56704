"""Every prompt tokenized and length-checked at start-up.

A prompt longer than `rollout.max_prompt_length`, or one the tokenizer
cannot encode, used to fail only when the loader drew it, hours into a run
(RL step 15 in one report). `check_prompts` runs every prompt of a source
through the rollouts' own encoding before the first step and names the
file and line (`data.JsonlSource.where`) of each bad one.

It also warns, once, about examples of a file whose answer is empty (or
whitespace): allowed, as a reward may not use the answer (`format`, a
length penalty), but `exact_match` and `math_answer` score those rows 0
whatever the response, so the warning names the file, the count and the
first five lines. (An empty prompt is refused when the file is read.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from absl import logging

from jaxcorr.data.prompts import format_prompt
from jaxcorr.data.reasoning_gym import CHECKED_ROWS, ReasoningGymSource
from jaxcorr.data.tasks import ArithmeticSource, Example


def _where(source: Sequence[Example], i: int) -> str:
  if hasattr(source, 'where'):
    return source.where(i)
  return f'example {i} of {source!r}'


def _longest(source: Sequence[Example]) -> list[tuple[str, Example]]:
  """The examples whose prompts must be checked: all of a file; for the
  generated arithmetic task (100,000 examples by default) the longest
  prompt of each operator, `'<max_operand><op><max_operand>='`, which
  bounds every other (one token per character); for a reasoning-gym task,
  whose prompts nothing bounds, its first `CHECKED_ROWS` rows."""
  if isinstance(source, ArithmeticSource):
    m = source.max_operand
    return [
      (f'the longest {source!r} prompt', Example(f'{m}{op}{m}=', ''))
      for op in sorted(set(source.ops))
    ]
  n = len(source)
  if isinstance(source, ReasoningGymSource):
    n = min(n, CHECKED_ROWS)
  return [(_where(source, i), source[i]) for i in range(n)]


class PromptError(ValueError):
  """Prompts the run cannot use: a start-up error the command lines print
  as one line (`jaxcorr.main`), naming the field and the rows."""


def _listed(bad: list[str], what: str, advice: str) -> str:
  more = f' (and {len(bad) - 5} more)' if len(bad) > 5 else ''
  return f'{len(bad)} {what}: {"; ".join(bad[:5])}{more}; {advice}'


def check_prompts(
  source: Sequence[Example],
  encode: Callable[[str], Sequence[int]],
  *,
  template: str,
  max_prompt_length: int,
) -> None:
  """Tokenizes every prompt of `source` as the rollouts will
  (`encode(format_prompt(template, ex))`) and raises one `PromptError`
  naming the file and line of each prompt (first five of each kind, and
  the counts) that the tokenizer rejects or that is longer than
  `max_prompt_length`, with the fix of each kind."""
  too_long, rejected = [], []
  for where, ex in _longest(source):
    try:
      n = len(encode(format_prompt(template, ex)))
    except ValueError as e:
      if 'prompt_template' in str(e):
        raise
      rejected.append(f'{where}: {e}')
      continue
    except Exception as e:  # a tokenizer's own error type
      rejected.append(f'{where}: {type(e).__name__}: {e}')
      continue
    if n > max_prompt_length:
      too_long.append(f'{where}: {n} tokens')
  _warn_empty_answers(source)
  parts = []
  if too_long:
    parts.append(
      _listed(
        too_long,
        f'longer than config.rollout.max_prompt_length={max_prompt_length}',
        'raise the limit or remove those rows',
      )
    )
  if rejected:
    parts.append(
      _listed(
        rejected,
        'that the tokenizer cannot encode',
        "a model from scratch encodes any text with config.data.tokenizer='"
        "bytes'; or remove those rows",
      )
    )
  if parts:
    count = len(too_long) + len(rejected)
    raise PromptError(
      f'{count} prompt(s) cannot be used: ' + ' | '.join(parts) + '.'
    )


def _warn_empty_answers(source: Sequence[Example]) -> None:
  """One warning naming the examples of a file with an empty answer."""
  if isinstance(source, (ArithmeticSource, ReasoningGymSource)):
    return
  empty = [i for i in range(len(source)) if not source[i].answer.strip()]
  if empty:
    logging.warning(
      '%d of %d examples have an empty answer: %s%s. exact_match and '
      'math_answer score those rows 0 whatever the response; fine only for '
      'rewards that ignore the answer.',
      len(empty),
      len(source),
      '; '.join(_where(source, i) for i in empty[:5]),
      f' (and {len(empty) - 5} more)' if len(empty) > 5 else '',
    )
