"""reasoning-gym tasks as a prompt source (`config.data.source=
'reasoning_gym'`; `pip install jaxcorr[reasoning_gym]`).

reasoning-gym's procedural generators give an unlimited stream of
verifiable problems without a download. Item `i` of a generator with seed
`s` is drawn from `random.Random(s + i)` (a weighted mix picks the task
from the same draw), so, like the arithmetic task, a row is a pure function
of `(task, config, seed, size, i)`: the source stores nothing, two
processes agree on row `i`, and the loader's resume is exact.

The scorer hands a reward `(response, answer)` strings only, and a task's
`score_answer(answer, entry)` needs the whole entry (its metadata holds
tuples and sets that JSON would not give back unchanged). So a row's
`Example.answer` is a *reference key*: `'reasoning_gym:'` followed by the
JSON of the task spec, seed, size and index. The `reasoning_gym` reward
(`jaxcorr.rewards.verifiers`) regenerates the entry from it (`entry`,
cached) and calls the task's own `score_answer`; the key is
self-contained, so worker processes (`reward.isolation='process'`) score
it too. Rewards that compare the answer text (`exact_match`,
`math_answer`, `math_verify`) and SFT warm-up, which would train on the
key, are refused at start-up (`check`).

Training rows use `config.data.seed`; evaluation rows use
`seed + num_examples`, whose per-item seeds `seed + num_examples + j`
never meet the training ones `seed + i`, `i < num_examples`.
"""

from __future__ import annotations

import collections.abc
import functools
import importlib
import importlib.util
import json
import re
import threading
from typing import Any

from jaxcorr.data.tasks import Example

PREFIX = 'reasoning_gym:'
# The start-up prompt check tokenizes this many rows of a source (not all
# of a virtual 100,000): generation is cheap, not free.
CHECKED_ROWS = 512
# Rewards that read the answer text, which here is a key (module doc).
ANSWER_TEXT_REWARDS = (
  'exact_match',
  'arith_exact',
  'math_answer',
  'math_verify',
)
_TASK = 'config.data.task'
_CONFIG = 'config.data.task_config'
_NAME = re.compile(r'[a-z0-9_]+')


def _module() -> Any:
  if importlib.util.find_spec('reasoning_gym') is None:
    raise ValueError(
      "config.data.source='reasoning_gym' needs the 'reasoning_gym' "
      'package; install it with: pip install jaxcorr[reasoning_gym]'
    )
  return importlib.import_module('reasoning_gym')


def task_names() -> list[str]:
  """Every task reasoning-gym registers, sorted."""
  _module()
  factory = importlib.import_module('reasoning_gym.factory')
  return sorted(factory.DATASETS)


def parse_tasks(text: str) -> tuple[tuple[str, float], ...]:
  """`'name'` or `'name:weight,name:weight'` -> ((name, weight), ...); a
  name without a weight has weight 1. Checks the syntax, not the names."""
  out = []
  for item in str(text).split(','):
    name, sep, weight = item.partition(':')
    name = name.strip()
    try:
      w = float(weight) if sep else 1.0
    except ValueError:
      w = -1.0
    if not _NAME.fullmatch(name) or not w > 0 or w == float('inf'):
      raise ValueError(
        f'{_TASK}: invalid entry {item.strip()!r} in {text!r}; allowed: a '
        "task name or 'name:weight,name:weight' (weights > 0), e.g. "
        "'chain_sum' or 'chain_sum:2,leg_counting:1'"
      )
    out.append((name, w))
  names = [n for n, _ in out]
  if len(set(names)) != len(names):
    raise ValueError(f'{_TASK}: {text!r} names a task twice')
  return tuple(out)


def parse_task_config(
  text: str, tasks: tuple[tuple[str, float], ...]
) -> dict[str, dict[str, Any]]:
  """`config.data.task_config` -> {task: the generator's config kwargs}.

  One task: a JSON object of its config's fields (`'{"min_terms": 2}'`).
  Several: a JSON object keyed by task name (`'{"chain_sum":
  {"max_terms": 3}}'`); tasks left out use their defaults. `''`: defaults.
  `seed` and `size` come from `config.data`, not from here."""
  names = [n for n, _ in tasks]
  if not str(text).strip():
    return {n: {} for n in names}
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f'{_CONFIG}: invalid JSON {text!r} ({e})') from None
  if not isinstance(value, dict):
    raise ValueError(f'{_CONFIG}: {text!r}; allowed: a JSON object')
  per_task = {names[0]: value} if len(names) == 1 else value
  unknown = sorted(set(per_task) - set(names))
  if unknown or not all(isinstance(v, dict) for v in per_task.values()):
    raise ValueError(
      f'{_CONFIG}: {text!r}; allowed with several tasks: an object keyed by '
      f'task name ({", ".join(names)}) whose values are objects'
    )
  for n, kwargs in per_task.items():
    for reserved in ('seed', 'size'):
      if reserved in kwargs:
        raise ValueError(
          f'{_CONFIG}: {reserved!r} of task {n!r} is set by config.data.'
          f'{"seed" if reserved == "seed" else "num_examples"}, not here'
        )
  return {n: dict(per_task.get(n, {})) for n in names}


def _spec(task: str, task_config: str) -> str:
  """The canonical JSON of a task spec (part of every reference key)."""
  tasks = parse_tasks(task)
  config = parse_task_config(task_config, tasks)
  return json.dumps(
    {'tasks': [list(t) for t in tasks], 'config': config},
    sort_keys=True,
    separators=(',', ':'),
  )


_LOCK = threading.Lock()


@functools.lru_cache(maxsize=16)
def _dataset_cached(spec: str, seed: int, size: int) -> Any:
  rg = _module()
  value = json.loads(spec)
  tasks, config = value['tasks'], value['config']
  if len(tasks) == 1:
    name = tasks[0][0]
    return rg.create_dataset(name, seed=seed, size=size, **config[name])
  composite = importlib.import_module('reasoning_gym.composite')
  return composite.CompositeDataset(
    composite.CompositeConfig(
      size=size,
      seed=seed,
      datasets=[
        composite.DatasetSpec(name=n, weight=w, config=config[n])
        for n, w in tasks
      ],
    )
  )


def dataset(spec: str, seed: int, size: int) -> Any:
  """The reasoning-gym dataset of a canonical spec (cached; built under a
  lock, as reward threads may ask for it at once)."""
  with _LOCK:
    return _dataset_cached(spec, seed, size)


def reference_key(spec: str, seed: int, size: int, index: int) -> str:
  """A row's `Example.answer`: the prefix and the JSON of its address."""
  address = {
    'spec': json.loads(spec),
    'seed': seed,
    'size': size,
    'index': index,
  }
  return PREFIX + json.dumps(address, sort_keys=True, separators=(',', ':'))


@functools.lru_cache(maxsize=4096)
def entry(key: str) -> tuple[Any, dict[str, Any]]:
  """(dataset, entry) of a reference key, regenerated deterministically
  (cached: the samples of one prompt share it). ValueError for an answer
  that is not a key (a row of another source)."""
  if not isinstance(key, str) or not key.startswith(PREFIX):
    raise ValueError(
      f'the reasoning_gym reward needs rows of config.data.source='
      f"'reasoning_gym' (answers starting {PREFIX!r}), got {str(key)[:60]!r}"
    )
  a = json.loads(key[len(PREFIX) :])
  spec = json.dumps(a['spec'], sort_keys=True, separators=(',', ':'))
  ds = dataset(spec, a['seed'], a['size'])
  return ds, ds[a['index']]


def extract(response: str) -> str | None:
  """The reply's answer as reasoning-gym reads it: the stripped text of the
  last `<answer>...</answer>`, None without one."""
  utils = importlib.import_module('reasoning_gym.utils')
  return utils.extract_answer(response, tag_name='answer')


class ReasoningGymSource(collections.abc.Sequence):
  """`size` rows of a reasoning-gym task (or weighted mix): row i is
  `Example(entry['question'], reference_key(..., i))`, generated on
  access. `entry(i)` is the task's own entry."""

  def __init__(self, task: str, task_config: str, seed: int, size: int):
    self.spec = _spec(task, task_config)
    self.task, self.seed, self.size = task, int(seed), int(size)
    self._dataset = dataset(self.spec, self.seed, self.size)

  def __len__(self) -> int:
    return self.size

  def entry(self, i: int) -> dict[str, Any]:
    return self._dataset[i]

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self[j] for j in range(*i.indices(self.size))]
    if not -self.size <= i < self.size:
      raise IndexError(f'index {i} out of range for {self.size} examples')
    i %= self.size
    row = self._dataset[i]
    return Example(
      prompt=row['question'],
      answer=reference_key(self.spec, self.seed, self.size, i),
      # A mix's row names its own task (reasoning-gym's composite metadata).
      task=row.get('metadata', {}).get('source_dataset', ''),
    )

  def where(self, i: int) -> str:
    return f'reasoning_gym task {self.task!r} (seed {self.seed}) row {i}'

  def __repr__(self) -> str:
    return (
      f'ReasoningGymSource({self.task!r}, seed={self.seed}, size={self.size})'
    )


def check(data: Any, reward_names: tuple[str, ...], sft_steps: int) -> None:
  """Start-up checks of `config.data.source='reasoning_gym'` (run by
  `jaxcorr.train.build.check_components`): the package is installed, every
  task is one reasoning-gym knows (the error lists some), the task config
  builds the generator and yields a row, no reward reads the answer text
  and no SFT warm-up (module doc)."""
  tasks = parse_tasks(data.task)
  known = task_names()
  for name, _ in tasks:
    if name not in known:
      close = [k for k in known if k[:3] == name[:3]] or known
      raise ValueError(
        f'{_TASK}: unknown reasoning-gym task {name!r}; allowed: '
        f'{", ".join(close[:8])}, ... ({len(known)} tasks: '
        'reasoning_gym.factory.DATASETS)'
      )
  try:
    ReasoningGymSource(data.task, data.task_config, data.seed, 1)[0]
  except (TypeError, ValueError, AssertionError, KeyError) as e:
    raise ValueError(
      f'{_CONFIG}: {data.task_config!r} does not build task {data.task!r}: '
      f'{type(e).__name__}: {e}'
    ) from None
  text_rewards = sorted(set(reward_names) & set(ANSWER_TEXT_REWARDS))
  if text_rewards:
    raise ValueError(
      f'config.reward.functions: {", ".join(text_rewards)} compare the '
      "answer text, which for config.data.source='reasoning_gym' is a "
      "reference key; allowed: 'reasoning_gym' (the task's own scorer) and "
      'rewards that ignore the answer (format, your own)'
    )
  if sft_steps:
    raise ValueError(
      f'config.train.sft_steps: invalid value {sft_steps!r} with '
      "config.data.source='reasoning_gym'; allowed: 0 (the rows' answers "
      'are reference keys, not text to imitate)'
    )
