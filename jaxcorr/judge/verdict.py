"""A judge's verdict: the rubric prompt it answers and the parser of its
reply.

The verdict is the first match of a configurable regex with one group in
the judge's reply: 'Score: 7' by default. A number N scores
min(max(N, 0), max_score) / max_score, in [0, 1]; 'yes' / 'no' (any case)
score 1 / 0. A reply with no match, or a group that is neither, raises
`UnparsedVerdict`: the scorer counts it in `reward/failures` (and stops a
run whose judge never answers in the format), never a 0 that looks like a
bad reply.
"""

from __future__ import annotations

import re

DEFAULT_RUBRIC = (
  'You grade answers. Reference answer: {answer}\n'
  'Answer to grade: {response}\n'
  'Is the answer correct and complete? Reply with one line: '
  "'Score: N', N from 0 (wrong) to 10 (right)."
)
DEFAULT_VERDICT = r'Score:\s*(-?\d+(?:\.\d+)?)'


class UnparsedVerdict(ValueError):
  """The judge's reply holds no verdict the parser can read."""


def compile_verdict(pattern: str, path: str = 'verdict') -> re.Pattern:
  """The verdict regex; ValueError naming `path` unless it compiles and
  has exactly one group."""
  try:
    compiled = re.compile(pattern)
  except re.error as e:
    raise ValueError(
      f'{path}: invalid value {pattern!r} ({e}); allowed: a regex with one '
      "group, e.g. 'Score: *([0-9]+)'"
    ) from None
  if compiled.groups != 1:
    raise ValueError(
      f'{path}: invalid value {pattern!r} ({compiled.groups} groups); '
      "allowed: a regex with one group, e.g. 'Score: *([0-9]+)'"
    )
  return compiled


def parse_verdict(reply: str, verdict: re.Pattern, max_score: float) -> float:
  """The score in [0, 1] of a judge's `reply` (module doc)."""
  match = verdict.search(reply)
  if match is None:
    raise UnparsedVerdict(f'no verdict in the judge reply {reply[:80]!r}')
  text = match.group(1).strip()
  if text.lower() in ('yes', 'no'):
    return float(text.lower() == 'yes')
  try:
    value = float(text)
  except ValueError:
    raise UnparsedVerdict(
      f'the verdict {text[:40]!r} is neither a number nor yes/no'
    ) from None
  return min(max(value, 0.0), max_score) / max_score
