"""Final answers in model text: GSM8K's '#### 72', LaTeX's `\\boxed{}`,
numbers written as '1,234', '$5', '3/4' or '\\frac{3}{4}'."""

from __future__ import annotations

import math
import re

# A number as written in a solution: 1234, 1,234, -3.5, .5, 3/4.
_NUM = re.compile(r'-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+)?')
_FLOAT = re.compile(r'[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?')
_FRAC = re.compile(r'([-+]?\d+)\s*/\s*(\d+)')
_TEX_FRAC = re.compile(r'(-?)\\[dt]?frac\{\s*(-?\d+)\s*\}\{\s*(\d+)\s*\}')
BOXED = re.compile(r'\\boxed\s*\{')
FINAL_NUMBER = re.compile(r'####\s*\$?\s*-?\$?(?:\d|\.\d)')


def to_number(text: str) -> float | None:
  """`text` as a finite float, or None: '1,234' -> 1234, '$5' -> 5,
  '72.' -> 72, '3/4' and '\\frac{3}{4}' -> 0.75."""
  t = text.strip().replace(',', '').replace('$', '').strip().rstrip('.')
  if _FLOAT.fullmatch(t):
    value = float(t)
  elif m := _FRAC.fullmatch(t):
    den = int(m.group(2))
    if den == 0:
      return None
    value = int(m.group(1)) / den
  elif m := _TEX_FRAC.fullmatch(t):
    den = int(m.group(3))
    if den == 0:
      return None
    value = int(m.group(2)) / den * (-1 if m.group(1) else 1)
  else:
    return None
  return value if math.isfinite(value) else None


def last_boxed(text: str) -> str | None:
  """The content of the last balanced `\\boxed{...}`, or None."""
  for m in reversed(list(BOXED.finditer(text))):
    depth, start = 1, m.end()
    for i in range(start, len(text)):
      if text[i] == '{':
        depth += 1
      elif text[i] == '}':
        depth -= 1
        if depth == 0:
          return text[start:i].strip()
  return None


def extract_answer(text: str) -> str | None:
  """A response's final answer: after the last '####' (its number, when the
  rest is not one), else the last `\\boxed{}`, else the last number."""
  if '####' in text:
    tail = text.rsplit('####', 1)[1].strip()
    tail = tail.splitlines()[0].strip() if tail else ''
    if to_number(tail) is not None:
      return tail
    m = _NUM.search(tail.replace('$', ''))
    if m:
      return m.group()
    return tail or None
  boxed = last_boxed(text)
  if boxed is not None:
    return boxed
  nums = _NUM.findall(text.replace('$', ''))
  return nums[-1] if nums else None


def _normalise(text: str) -> str:
  return re.sub(r'\s+', '', text.replace('$', '')).lower().rstrip('.')


def answers_match(predicted: str, reference: str) -> bool:
  """Numerically (|a - b| <= 1e-6, relative or absolute) when both parse
  as numbers, else as normalised strings (no spaces or '$', lower case)."""
  a, b = to_number(predicted), to_number(reference)
  if a is not None and b is not None:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)
  return _normalise(predicted) == _normalise(reference)
