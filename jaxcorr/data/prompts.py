"""Prompt sources and the deterministic, checkpointable prompt loader.

A source is any `Sequence[Example]`: the generated arithmetic task
(`tasks.ArithmeticSource`), a reasoning-gym task
(`reasoning_gym.ReasoningGymSource`) or a local JSONL / Parquet file read whole at
start-up (RL prompt sets are small: GSM8K's train split is 7,473 rows).
Reading everything up front turns a malformed row 6,000 into a start-up
error instead of a crash hours into a run; `check_prompts` does the same for
prompts too long for `rollout.max_prompt_length` or that the tokenizer
cannot encode (`jaxcorr.data.prompt_check`), naming the file and line
(bytes that are not UTF-8 too).

An empty (whitespace-only) prompt is a row error too (the model would see
the template alone); empty answers are warned about by `check_prompts`.

`PromptLoader` walks a virtual infinite stream over the source: stream
position p is example `perm_e[p % n]` of epoch `e = p // n`, where `perm_e`
is a permutation drawn from (seed, e) alone. The whole loader state is
therefore one integer, the position, and resuming is exact by construction:
no RNG state to save, no dependence on how many batches a process has seen.
Every process holds the same position and reads its own contiguous slice of
each global batch, so the shares are disjoint and together they are exactly
the single-process batch. A dataset whose size changed (a bad row removed)
resumes at the same epoch and fraction of it, with a warning.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

from jaxcorr.data.code_tasks import CodeSource
from jaxcorr.data.config import ANSWER_FORMATS, SOURCES, DataConfig
from jaxcorr.data.reasoning_gym import ReasoningGymSource
from jaxcorr.data.tasks import ArithmeticSource, Example

# The config.data defaults, for mappings that leave a field out.
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DataConfig)}


def gsm8k_answer(text: str) -> str:
  """The final answer of a GSM8K solution: the text after the last '####',
  stripped, without thousands separators ('#### 1,234' -> '1234').
  ValueError when there is no '####' or nothing after it."""
  if '####' not in text:
    raise ValueError("no '####' final-answer marker")
  final = text.rsplit('####', 1)[1].strip().replace(',', '')
  if not final:
    raise ValueError("nothing after the '####' final-answer marker")
  return final


def _check_format(answer_format: str) -> None:
  if answer_format not in ANSWER_FORMATS:
    raise ValueError(
      f'config.data.answer_format: invalid value {answer_format!r}; '
      f'allowed: {", ".join(repr(a) for a in ANSWER_FORMATS)}'
    )


def _check_file(path: str | os.PathLike, kind: str) -> str:
  path = os.fspath(path)
  if not path:
    raise ValueError(
      f'config.data.path: invalid value {path!r}; allowed: a local {kind} file'
    )
  if not os.path.isfile(path):
    raise ValueError(
      f'config.data.path: {kind} file {path!r} does not exist (or is not a '
      'file)'
    )
  return path


class _FileSource(Sequence):
  """A file's examples, loaded whole at construction."""

  kind = ''

  def __init__(
    self,
    path: str | os.PathLike,
    *,
    prompt_field: str = 'question',
    answer_field: str = 'answer',
    answer_format: str = 'gsm8k',
  ):
    _check_format(answer_format)
    self.path = _check_file(path, self.kind)
    self.prompt_field = prompt_field
    self.answer_field = answer_field
    self.answer_format = answer_format
    self._where: list[str] = []  # 'line 7' / 'row 6' of each example
    self._examples = self._load()
    if not self._examples:
      raise ValueError(
        f'config.data.path: {self.kind} file {self.path!r} holds no examples'
      )

  def _load(self) -> list[Example]:
    raise NotImplementedError

  def where(self, i: int) -> str:
    """Where example `i` is: "JSONL file 'x.jsonl' line 7"."""
    return f'{self.kind} file {self.path!r} {self._where[i]}'

  def _example(self, where: str, prompt: Any, answer: Any) -> Example:
    """One row's fields -> Example; `where` is 'line 3' or 'row 2'."""
    ctx = f'{self.kind} file {self.path!r} {where}'
    self._where.append(where)
    if not isinstance(prompt, str):
      raise ValueError(
        f'{ctx}: prompt field {self.prompt_field!r} '
        f'(config.data.prompt_field) must be a string, got {prompt!r}'
      )
    if not prompt.strip():
      raise ValueError(
        f'{ctx}: prompt field {self.prompt_field!r} is empty ({prompt!r}); '
        'remove the row (the model would see the template alone)'
      )
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
      answer = str(answer)
    if not isinstance(answer, str):
      raise ValueError(
        f'{ctx}: answer field {self.answer_field!r} '
        f'(config.data.answer_field) must be a string or a number, got '
        f'{answer!r}'
      )
    if self.answer_format == 'gsm8k':
      try:
        answer = gsm8k_answer(answer)
      except ValueError as e:
        raise ValueError(
          f'{ctx}: answer field {self.answer_field!r}: {e} (answer_format='
          f"'gsm8k'; set config.data.answer_format='raw' to keep answers as "
          f'they are): {answer[-80:]!r}'
        ) from None
    return Example(prompt=prompt, answer=answer)

  def _missing(self, where: str, available: Sequence[str]) -> None:
    for field, name in (
      (self.prompt_field, 'prompt_field'),
      (self.answer_field, 'answer_field'),
    ):
      if field not in available:
        raise ValueError(
          f'{self.kind} file {self.path!r} {where}: missing field '
          f'{field!r} (config.data.{name}); available fields: '
          f'{", ".join(repr(a) for a in available) or "none"}'
        )

  def __len__(self) -> int:
    return len(self._examples)

  def __getitem__(self, i):
    return self._examples[i]

  def __repr__(self) -> str:
    return f'{type(self).__name__}({self.path!r}, {len(self)} examples)'


class JsonlSource(_FileSource):
  """One JSON object per line (blank lines skipped), e.g. GSM8K's
  `{"question": ..., "answer": "... #### 72"}`."""

  kind = 'JSONL'

  def _load(self) -> list[Example]:
    out = []
    with open(self.path, 'rb') as f:
      for lineno, raw in enumerate(f, 1):
        where = f'line {lineno}'
        try:
          line = raw.decode('utf-8')
        except UnicodeDecodeError as e:
          raise ValueError(
            f'{self.kind} file {self.path!r} {where}: not UTF-8 (byte '
            f'{raw[e.start]:#04x} at column {e.start + 1}: {e.reason})'
          ) from None
        if not line.strip():
          continue
        try:
          row = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(
            f'{self.kind} file {self.path!r} {where}: invalid JSON ({e})'
          ) from None
        if not isinstance(row, dict):
          raise ValueError(
            f'{self.kind} file {self.path!r} {where}: expected a JSON '
            f'object, got {type(row).__name__}'
          )
        self._missing(where, list(row))
        out.append(
          self._example(where, row[self.prompt_field], row[self.answer_field])
        )
    return out


class ParquetSource(_FileSource):
  """A Parquet table with one row per example (read with pyarrow)."""

  kind = 'Parquet'

  def _load(self) -> list[Example]:
    import pyarrow.parquet as pq  # only Parquet users pay for the import

    try:
      names = list(pq.read_schema(self.path).names)
    except Exception as e:
      raise ValueError(
        f'{self.kind} file {self.path!r}: cannot read the schema ({e})'
      ) from None
    self._missing('(schema)', names)
    table = pq.read_table(
      self.path, columns=[self.prompt_field, self.answer_field]
    )
    prompts = table.column(self.prompt_field).to_pylist()
    answers = table.column(self.answer_field).to_pylist()
    return [
      self._example(f'row {i}', p, a)
      for i, (p, a) in enumerate(zip(prompts, answers))
    ]


def _get(cfg: Any, key: str) -> Any:
  """A field of a mapping, a ConfigDict or a dataclass (default if absent)."""
  if isinstance(cfg, Mapping):
    return cfg.get(key, _DEFAULTS[key])
  try:
    return getattr(cfg, key)
  except (AttributeError, KeyError):
    return _DEFAULTS[key]


def _file_source(cfg: Any, source: str, path: str) -> Sequence[Example]:
  cls = JsonlSource if source == 'jsonl' else ParquetSource
  return cls(
    path,
    prompt_field=_get(cfg, 'prompt_field'),
    answer_field=_get(cfg, 'answer_field'),
    answer_format=_get(cfg, 'answer_format'),
  )


def _generated(cfg: Any, seed: int, size: int) -> Sequence[Example]:
  if _get(cfg, 'source') == 'code':
    return CodeSource(size, seed)
  return ReasoningGymSource(
    _get(cfg, 'task'), _get(cfg, 'task_config'), seed, size
  )


def _source_name(cfg: Any) -> str:
  source = _get(cfg, 'source')
  if source not in SOURCES:
    raise ValueError(
      f'config.data.source: invalid value {source!r}; allowed: '
      f'{", ".join(repr(s) for s in SOURCES)}'
    )
  return source


def make_source(cfg: Any) -> Sequence[Example]:
  """The training source of `config.data` (a mapping, ConfigDict or the
  validated `DataConfig`)."""
  source = _source_name(cfg)
  if source == 'arithmetic':
    return ArithmeticSource(
      _get(cfg, 'num_examples'),
      _get(cfg, 'seed'),
      _get(cfg, 'max_operand'),
      _get(cfg, 'ops'),
    )
  if source in ('reasoning_gym', 'code'):
    return _generated(cfg, _get(cfg, 'seed'), _get(cfg, 'num_examples'))
  return _file_source(cfg, source, _get(cfg, 'path'))


def make_eval_source(cfg: Any) -> Sequence[Example] | None:
  """The evaluation source of `config.data`, or None when there is none.

  arithmetic: `eval_examples` examples drawn with `seed + 1` (None when 0).
  reasoning_gym, code: `eval_examples` rows drawn with `seed +
  num_examples` (not the training rows' seed).
  jsonl/parquet: the file at `eval_path` with the training file's fields
  (None when `eval_path` is '').
  """
  source = _source_name(cfg)
  if source in ('reasoning_gym', 'code'):
    n = _get(cfg, 'eval_examples')
    seed = _get(cfg, 'seed') + _get(cfg, 'num_examples')
    return _generated(cfg, seed, n) if n else None
  if source == 'arithmetic':
    n = _get(cfg, 'eval_examples')
    if not n:
      return None
    return ArithmeticSource(
      n, _get(cfg, 'seed') + 1, _get(cfg, 'max_operand'), _get(cfg, 'ops')
    )
  path = _get(cfg, 'eval_path')
  return _file_source(cfg, source, path) if path else None


def format_prompt(template: str, example: Example) -> str:
  """`template.format(prompt=example.prompt)`.

  The template is a `str.format` string: its only field is `{prompt}`, and
  literal braces are doubled (`'\\\\boxed{{}}'` renders as `\\boxed{}`).
  """
  if '{prompt}' not in template:
    raise ValueError(
      f'config.data.prompt_template: invalid value {template!r}; allowed: a '
      "string containing '{prompt}'"
    )
  try:
    return template.format(prompt=example.prompt)
  except (KeyError, IndexError, ValueError) as e:
    raise ValueError(
      f'config.data.prompt_template: invalid value {template!r} ({e!r}); '
      "allowed: a str.format string whose only field is '{prompt}' (write "
      "literal braces as '{{' and '}}')"
    ) from None


def _count(name: str, value: Any, lo: int) -> int:
  if (
    isinstance(value, bool)
    or not isinstance(value, (int, np.integer))
    or value < lo
  ):
    raise ValueError(
      f'PromptLoader {name}: invalid value {value!r}; allowed: an int >= {lo}'
    )
  return int(value)


class PromptLoader:
  """Global batches of prompts from a virtual infinite, epoch-shuffled stream.

  Position p (counted in prompts, the same on every process) is example
  `perm_e[p % n]` of epoch `e = p // n`; `perm_e` is drawn from
  `np.random.default_rng([seed, e])` (the identity when `shuffle=False`).
  A global batch is the positions [p, p + batch_size); process i returns
  its contiguous share [p + i*k, p + (i+1)*k), k = batch_size //
  process_count. A batch may span the end of one epoch and the start of the
  next; every example appears exactly once in each epoch's n positions.

  The state is `{'position', 'seed', 'shuffle', 'num_examples'}`:
  `restore` refuses a state from another seed or order, since the stream
  it describes would not be this loader's. A state from a dataset of
  another size (a bad row removed) continues at the same epoch and the same
  fraction of it, with a warning: the order within that epoch differs.
  """

  def __init__(
    self,
    source: Sequence[Example],
    *,
    batch_size: int,
    seed: int,
    shuffle: bool = True,
    process_index: int = 0,
    process_count: int = 1,
  ):
    self.batch_size = _count('batch_size', batch_size, 1)
    self.seed = _count('seed', seed, 0)
    self.process_count = _count('process_count', process_count, 1)
    self.process_index = _count('process_index', process_index, 0)
    if self.process_index >= self.process_count:
      raise ValueError(
        f'PromptLoader process_index: invalid value {process_index!r}; '
        f'allowed: 0 <= process_index < process_count ({process_count})'
      )
    if self.batch_size % self.process_count:
      raise ValueError(
        f'PromptLoader batch_size: invalid value {batch_size!r}; allowed: a '
        f'multiple of process_count ({process_count}), so that every '
        'process gets an equal share of each global batch'
      )
    if not isinstance(shuffle, bool):
      raise ValueError(
        f'PromptLoader shuffle: invalid value {shuffle!r}; allowed: True, False'
      )
    if len(source) < 1:
      raise ValueError('PromptLoader source: the source holds no examples')
    self.source = source
    self.shuffle = shuffle
    self.per_process = self.batch_size // self.process_count
    self._position = 0
    self._perms: dict[int, np.ndarray] = {}

  @property
  def position(self) -> int:
    """Prompts consumed so far by all processes together."""
    return self._position

  @property
  def epoch(self) -> int:
    """The epoch of the next prompt."""
    return self._position // len(self.source)

  def _perm(self, epoch: int) -> np.ndarray:
    perm = self._perms.get(epoch)
    if perm is None:
      rng = np.random.default_rng([self.seed, epoch])
      perm = rng.permutation(len(self.source))
      # A batch spans at most a few epochs; keep the latest two.
      self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
      self._perms[epoch] = perm
    return perm

  def index_at(self, position: int) -> int:
    """The source index at a stream position."""
    n = len(self.source)
    epoch, offset = divmod(position, n)
    if not self.shuffle:
      return offset
    return int(self._perm(epoch)[offset])

  def next_batch(self) -> list[Example]:
    """This process's share of the next global batch; advances the stream
    by the whole global batch."""
    start = self._position + self.process_index * self.per_process
    batch = [
      self.source[self.index_at(p)]
      for p in range(start, start + self.per_process)
    ]
    self._position += self.batch_size
    return batch

  def __iter__(self) -> Iterator[list[Example]]:
    while True:
      yield self.next_batch()

  def state(self) -> dict[str, Any]:
    """JSON-serialisable state (identical on every process)."""
    return {
      'position': self._position,
      'seed': self.seed,
      'shuffle': self.shuffle,
      'num_examples': len(self.source),
    }

  def restore(self, state: Mapping[str, Any]) -> None:
    """Continue exactly where the loader that produced `state` stopped.

    The batch size and process count may differ from the saved run's: the
    stream goes on from the same prompt.
    """
    position = state.get('position')
    if (
      isinstance(position, bool)
      or not isinstance(position, int)
      or position < 0
    ):
      raise ValueError(
        f'PromptLoader state position: invalid value {position!r}; '
        'allowed: an int >= 0'
      )
    mine = self.state()
    for key in ('seed', 'shuffle'):
      if key in state and state[key] != mine[key]:
        raise ValueError(
          f'PromptLoader state {key}: the checkpoint has {state[key]!r}, '
          f'this loader {mine[key]!r}; resuming would not continue the '
          'saved prompt stream'
        )
    saved_n, n = (
      state.get('num_examples', mine['num_examples']),
      len(self.source),
    )
    if saved_n != n:
      if (
        not isinstance(saved_n, int) or isinstance(saved_n, bool) or saved_n < 1
      ):
        raise ValueError(
          f'PromptLoader state num_examples: invalid value {saved_n!r}; '
          'allowed: an int >= 1'
        )
      epoch, offset = divmod(position, saved_n)
      new = epoch * n + min(offset * n // saved_n, n)
      logging.warning(
        'the dataset has %d examples, the checkpoint was written with %d: '
        'continuing at epoch %d, %.1f%% through it (position %d -> %d)',
        n,
        saved_n,
        epoch,
        100 * offset / saved_n,
        position,
        new,
      )
      position = new
    self._position = position
