"""The embedded arithmetic task and its character tokenizer (no downloads).

A trainer needs a task it can learn in minutes on a laptop to show that the
whole loop works: `17+25=` -> `42` with a 2-layer model from scratch. The
task is generated, never downloaded, and every example is a pure function
of `(seed, index)` (`np.random.default_rng([seed, index])`), so a source of
any length needs no memory, two processes agree on example `i` without
talking, and the loader's resume is exact whatever order examples were
read in.

`CharTokenizer` is the matching vocabulary: one id per character, small
enough (27 ids) for `config.model.vocab_size = 32`. Its ids are fixed in
code, so checkpoints never depend on a vocabulary file.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from collections.abc import Iterable
from typing import Any, overload

import numpy as np

from jaxcorr.config import fields

OPS = '+-*'
OP_TASKS = {'+': 'add', '-': 'sub', '*': 'mul'}
"""Each operator's task name (`Example.task`): what `distill.routes` names."""

_PAD, _BOS, _EOS = '<pad>', '<bos>', '<eos>'
# Ids 0-2 are the special tokens; then the arithmetic characters, then a few
# for templates such as 'Q: 17+25=?\nA: '. Order is part of the checkpoint
# format: append, never reorder.
_CHARS = '0123456789+-*= ()?:.,QA\n'


@dataclasses.dataclass(frozen=True)
class Example:
  """One prompt and its reference answer (the reward compares to it), and
  the task it belongs to ('': the data source's name; jaxcorr/data/
  task_ids.py turns it into the batch's per-row task id)."""

  prompt: str
  answer: str
  task: str = ''


class CharTokenizer:
  """A fixed character vocabulary for arithmetic text.

  Ids: 0 = PAD, 1 = BOS, 2 = EOS, then one id per character of
  `'0123456789+-*= ()?:.,QA\\n'`.
  """

  def __init__(self):
    self._id = {c: i + 3 for i, c in enumerate(_CHARS)}
    self._char = (_PAD, _BOS, _EOS, *_CHARS)

  @property
  def vocab_size(self) -> int:
    return len(self._char)

  @property
  def pad_id(self) -> int:
    return 0

  @property
  def bos_id(self) -> int:
    return 1

  @property
  def eos_id(self) -> int:
    return 2

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Ids that end a response (`jaxcorr.data.text.stop_ids`)."""
    return (self.eos_id,)

  @property
  def characters(self) -> str:
    """The encodable characters, in id order (id = position + 3)."""
    return _CHARS

  def encode(
    self, text: str, *, bos: bool = True, eos: bool = False
  ) -> list[int]:
    """Text -> ids, with BOS first (`bos`) and EOS last (`eos`, for SFT
    targets). ValueError for a character outside the vocabulary."""
    ids = [self.bos_id] if bos else []
    for pos, c in enumerate(text):
      i = self._id.get(c)
      if i is None:
        raise ValueError(
          f'CharTokenizer cannot encode character {c!r} at position {pos} '
          f'of {text!r}; allowed characters: {_CHARS!r}'
        )
      ids.append(i)
    if eos:
      ids.append(self.eos_id)
    return ids

  def decode(self, ids: Iterable[int]) -> str:
    """Ids -> text: stops at the first EOS, skips PAD and BOS.

    An id outside the vocabulary (a model whose embedding has more rows
    than the tokenizer has ids, e.g. vocab_size 32) decodes to U+FFFD, so
    it can never match a reference answer.
    """
    out = []
    for raw in ids:
      i = int(raw)
      if i == self.eos_id:
        break
      if i in (self.pad_id, self.bos_id):
        continue
      out.append(self._char[i] if 3 <= i < len(self._char) else '\ufffd')
    return ''.join(out)


def _check_task(seed: Any, max_operand: Any, ops: Any) -> None:
  """The arithmetic fields of config.data (same rules as DataConfig)."""
  fields.check(fields.integer(0), seed, 'config.data.seed')
  fields.check(fields.integer(1), max_operand, 'config.data.max_operand')
  if not isinstance(ops, str) or not ops or set(ops) - set(OPS):
    raise ValueError(
      f'config.data.ops: invalid value {ops!r}; allowed: a non-empty string '
      "of '+', '-', '*'"
    )


def _apply(a: int, op: str, b: int) -> int:
  if op == '+':
    return a + b
  if op == '-':
    return a - b
  return a * b


def arithmetic_example(
  seed: int, index: int, *, max_operand: int, ops: str = '+'
) -> Example:
  """Example `index` of the task with this seed: `'a<op>b='` -> the result.

  Operands are uniform in [0, max_operand], the operator uniform over the
  characters of `ops` (repeat one to weight it: '++-'). The example depends
  on (seed, index) only, never on which examples were drawn before.
  Subtraction may give a negative answer ('3-17=' -> '-14').
  """
  _check_task(seed, max_operand, ops)
  if (
    isinstance(index, bool)
    or not isinstance(index, (int, np.integer))
    or index < 0
  ):
    raise ValueError(f'index: invalid value {index!r}; allowed: an int >= 0')
  rng = np.random.default_rng([seed, int(index)])
  a, b = (int(x) for x in rng.integers(0, max_operand + 1, size=2))
  op = ops[int(rng.integers(len(ops)))]
  return Example(
    prompt=f'{a}{op}{b}=', answer=str(_apply(a, op, b)), task=OP_TASKS[op]
  )


class ArithmeticSource(collections.abc.Sequence):
  """`num_examples` generated examples: item i is
  `arithmetic_example(seed, i, ...)`, computed on access (no storage)."""

  def __init__(
    self, num_examples: int, seed: int, max_operand: int, ops: str = '+'
  ):
    if (
      isinstance(num_examples, bool)
      or not isinstance(num_examples, int)
      or num_examples < 1
    ):
      raise ValueError(
        f'config.data.num_examples: invalid value {num_examples!r}; '
        'allowed: an int >= 1'
      )
    _check_task(seed, max_operand, ops)
    self.num_examples = num_examples
    self.seed = seed
    self.max_operand = max_operand
    self.ops = ops

  def __len__(self) -> int:
    return self.num_examples

  @overload
  def __getitem__(self, i: int) -> Example: ...

  @overload
  def __getitem__(self, i: slice) -> list[Example]: ...

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self[j] for j in range(*i.indices(self.num_examples))]
    n = self.num_examples
    if not -n <= i < n:
      raise IndexError(f'index {i} out of range for {n} examples')
    return arithmetic_example(
      self.seed, i % n, max_operand=self.max_operand, ops=self.ops
    )

  def __repr__(self) -> str:
    return (
      f'ArithmeticSource(num_examples={self.num_examples}, seed={self.seed}, '
      f'max_operand={self.max_operand}, ops={self.ops!r})'
    )
