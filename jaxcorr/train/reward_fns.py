"""Reward functions registered by name, and the weighted, fail-safe scorer.

A reward function maps `(response, answer) -> float`: the decoded response
text and the example's reference answer. `config.reward.functions` names
them with weights, `'math_answer:1.0,format:0.1'`, and `RewardScorer` sums
them per row. User code adds its own with `@register('name')` in any module
the config file imports.

Rewards are user code running inside the training loop, so the scorer
contains them: a call that raises, returns something that is not a finite
number, or runs past `timeout_s` scores 0 for that function on that row and
is counted (`reward/failures`, `reward/timeouts`); `score` never raises
because of a reward function. Calls run on a small pool of daemon threads
with a per-call timeout measured from when the call starts. A Python thread
cannot be killed, so a timed-out call is abandoned: it keeps its thread,
a fresh worker takes its place (up to `MAX_ABANDONED` abandoned threads per
scorer), and `score` moves on. The threads are daemons because
`concurrent.futures.ThreadPoolExecutor` joins its (non-daemon) workers at
interpreter exit, so a single reward call that never returns would hang the
trainer's exit forever. Threads bound Python-level slowness and blocking
I/O; a C extension that holds the GIL (a pathological `re` match) stalls
the whole process and needs a subprocess-based reward instead.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import numbers
import queue
import re
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

RewardFn = Callable[[str, str], float]

REWARDS: dict[str, RewardFn] = {}

# Abandoned (timed-out, still running) threads a scorer replaces with fresh
# workers; past this, calls queue behind the stuck ones and time out.
MAX_ABANDONED = 64

_SPEC = 'config.reward.functions'
_NAME = re.compile(r'[A-Za-z_][A-Za-z0-9_.\-]*')
# A number as written in a solution: 1234, 1,234, -3.5, .5, 3/4.
_NUM = re.compile(r'-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+)?')
_FLOAT = re.compile(r'[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?')
_FRAC = re.compile(r'([-+]?\d+)\s*/\s*(\d+)')
_TEX_FRAC = re.compile(r'(-?)\\[dt]?frac\{\s*(-?\d+)\s*\}\{\s*(\d+)\s*\}')
_BOXED = re.compile(r'\\boxed\s*\{')
_FINAL_NUMBER = re.compile(r'####\s*\$?\s*-?\$?(?:\d|\.\d)')

_log = logging.getLogger(__name__)


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


# -- answer extraction -------------------------------------------------------


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
  for m in reversed(list(_BOXED.finditer(text))):
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
  if '####' in reference or _BOXED.search(reference):
    reference = extract_answer(reference) or reference
  return float(answers_match(predicted, reference))


@register('format')
def format_reward(response: str, answer: str) -> float:
  """1 when the response marks a final answer: '####' followed by a number,
  or a non-empty `\\boxed{...}`."""
  del answer
  if _FINAL_NUMBER.search(response):
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


# -- the scorer --------------------------------------------------------------


class _Task:
  __slots__ = ('abandoned', 'args', 'fn', 'future', 'replaced', 'start')

  def __init__(self, fn: Callable, args: tuple):
    self.fn, self.args = fn, args
    self.future: concurrent.futures.Future = concurrent.futures.Future()
    self.start: float | None = None
    self.abandoned = self.replaced = False


class _DaemonPool:
  """`max_workers` daemon threads on one FIFO queue; a worker stuck on an
  abandoned call is replaced (up to `max_abandoned` of them)."""

  def __init__(self, max_workers: int, max_abandoned: int):
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._max_abandoned = max_abandoned
    self.live = 0  # workers not running an abandoned call
    self.stuck = 0  # workers running an abandoned call
    self._closed = False
    with self._lock:
      for _ in range(max_workers):
        self._spawn()

  def _spawn(self) -> None:
    self.live += 1
    threading.Thread(
      target=self._work, name='jaxcorr-reward', daemon=True
    ).start()

  def _work(self) -> None:
    while True:
      task = self._queue.get()
      if task is None:
        return
      if task.future.set_running_or_notify_cancel():
        task.start = time.monotonic()
        try:
          result = task.fn(*task.args)
        except BaseException as e:  # reported through the future
          task.future.set_exception(e)
        else:
          task.future.set_result(result)
        with self._lock:
          if task.abandoned:
            self.stuck -= 1
            if task.replaced:
              return  # a fresh worker has taken this one's place
            self.live += 1
      del task

  def submit(self, fn: Callable, *args: Any) -> _Task:
    task = _Task(fn, args)
    self._queue.put(task)
    return task

  def abandon(self, task: _Task) -> bool:
    """Gives up on a running call; False if it has finished meanwhile."""
    with self._lock:
      if task.future.done():
        return False
      task.abandoned = True
      self.live -= 1
      self.stuck += 1
      if self.stuck <= self._max_abandoned:
        task.replaced = True
        self._spawn()
      return True

  def close(self) -> None:
    with self._lock:
      if self._closed:
        return
      self._closed = True
      for _ in range(self.live):
        self._queue.put(None)


def _valid(value: Any) -> float | None:
  """A reward value as a finite float, or None."""
  if (
    isinstance(value, np.ndarray)
    and value.ndim == 0
    and value.dtype.kind in 'biuf'
  ):
    value = value.item()
  if not isinstance(value, numbers.Real):
    return None
  value = float(value)
  return value if math.isfinite(value) else None


class RewardScorer:
  """The weighted sum of named rewards, one float32 per row.

  Args:
    spec: (name, weight) pairs, e.g. `parse_spec(config.reward.functions)`;
      names must be registered in `REWARDS` now.
    timeout_s: seconds one (function, row) call may run, from its start;
      None or 0 calls every function inline on the caller's thread (no
      timeout, exceptions still caught).
    max_workers: threads running calls concurrently.

  With a timeout, `score` takes at most about
  `ceil(calls / max_workers) * timeout_s` seconds even if every call hangs.
  """

  def __init__(
    self,
    spec: Sequence[tuple[str, float]],
    *,
    timeout_s: float | None = 5.0,
    max_workers: int = 4,
  ):
    spec = list(spec)
    if not spec:
      raise ValueError(
        f'{_SPEC}: no reward functions; allowed: {self._known()}'
      )
    names = [name for name, _ in spec]
    for name in names:
      if name not in REWARDS:
        raise ValueError(
          f'{_SPEC}: unknown reward {name!r}; registered: {self._known()} '
          '(register more with jaxcorr.train.reward_fns.register)'
        )
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
      raise ValueError(
        f'{_SPEC}: reward(s) {", ".join(map(repr, dupes))} listed more than '
        'once; allowed: each name once (add the weights)'
      )
    weights = []
    for name, weight in spec:
      w = _valid(weight)
      if w is None or isinstance(weight, bool):
        raise ValueError(
          f'{_SPEC}: invalid weight {weight!r} for {name!r}; allowed: a '
          'finite number'
        )
      weights.append(w)
    if timeout_s is not None and (_valid(timeout_s) is None or timeout_s < 0):
      raise ValueError(
        f'config.reward.timeout_s: invalid value {timeout_s!r}; allowed: a '
        'finite number >= 0 (0: no timeout)'
      )
    if (
      isinstance(max_workers, bool)
      or not isinstance(max_workers, int)
      or max_workers < 1
    ):
      raise ValueError(
        f'RewardScorer max_workers: invalid value {max_workers!r}; allowed: '
        'an int >= 1'
      )
    self.names = tuple(names)
    self.weights = np.asarray(weights, np.float64)
    self._fns = tuple(REWARDS[n] for n in names)
    self.timeout_s = float(timeout_s) if timeout_s else None
    self.max_workers = max_workers
    self._pool: _DaemonPool | None = None
    self._pool_lock = threading.Lock()
    self._warned: set[str] = set()

  @staticmethod
  def _known() -> str:
    return ', '.join(repr(n) for n in sorted(REWARDS))

  def __repr__(self) -> str:
    spec = ','.join(f'{n}:{w:g}' for n, w in zip(self.names, self.weights))
    return f'RewardScorer({spec!r}, timeout_s={self.timeout_s})'

  def _report(self, name: str, what: str, exc: BaseException | None) -> None:
    """Logs the first failure of each function (later ones only count)."""
    level = logging.DEBUG if name in self._warned else logging.WARNING
    self._warned.add(name)
    _log.log(
      level,
      'reward %r %s (scored 0; counted in reward/%s)',
      name,
      what,
      'timeouts' if what.startswith('timed out') else 'failures',
      exc_info=None if exc is None else (type(exc), exc, exc.__traceback__),
    )

  def _outcome(
    self, name: str, value: Any, exc: BaseException | None
  ) -> float | None:
    if exc is not None:
      self._report(name, f'raised {type(exc).__name__}: {exc}', exc)
      return None
    v = _valid(value)
    if v is None:
      self._report(name, f'returned {value!r}, not a finite number', None)
    return v

  def score(
    self, responses: Sequence[str], answers: Sequence[str]
  ) -> tuple[np.ndarray, dict[str, float]]:
    """(rewards float32 [B], metrics). Raises only for mismatched lengths
    (a caller bug); reward-function errors score 0 and are counted."""
    if isinstance(responses, str) or isinstance(answers, str):
      raise ValueError('RewardScorer.score: pass sequences of strings')
    if len(responses) != len(answers):
      raise ValueError(
        f'RewardScorer.score: {len(responses)} responses but '
        f'{len(answers)} answers'
      )
    n = len(responses)
    values = np.zeros((len(self._fns), n), np.float64)
    failures = timeouts = 0
    if self.timeout_s is None:
      for j, (name, fn) in enumerate(zip(self.names, self._fns)):
        for i in range(n):
          try:
            v = self._outcome(name, fn(responses[i], answers[i]), None)
          except Exception as e:
            v = self._outcome(name, None, e)
          if v is None:
            failures += 1
          else:
            values[j, i] = v
    else:
      pool = self._get_pool()
      tasks = [
        (j, i, pool.submit(fn, responses[i], answers[i]))
        for j, fn in enumerate(self._fns)
        for i in range(n)
      ]
      for j, i, task in tasks:
        status, v = self._wait(pool, task, self.names[j])
        if status == 'timeout':
          timeouts += 1
        elif v is None:
          failures += 1
        else:
          values[j, i] = v
    rewards = (self.weights[:, None] * values).sum(axis=0).astype(np.float32)
    metrics = {
      'reward/failures': float(failures),
      'reward/timeouts': float(timeouts),
    }
    for j, name in enumerate(self.names):
      metrics[f'reward/{name}/mean'] = float(values[j].mean()) if n else 0.0
    return rewards, metrics

  def _get_pool(self) -> _DaemonPool:
    with self._pool_lock:
      if self._pool is None:
        self._pool = _DaemonPool(self.max_workers, MAX_ABANDONED)
        # Idle workers end with the scorer even without close().
        weakref.finalize(self, self._pool.close)
      return self._pool

  def _wait(
    self, pool: _DaemonPool, task: _Task, name: str
  ) -> tuple[str, float | None]:
    """Waits for one call: ('ok', value or None) or ('timeout', None)."""
    assert self.timeout_s is not None
    fut = task.future
    while True:
      if fut.done():
        return 'ok', self._outcome(name, *_result(fut))
      if task.start is not None:
        remaining = task.start + self.timeout_s - time.monotonic()
        if remaining > 0:
          concurrent.futures.wait([fut], timeout=remaining)
          continue
        if pool.abandon(task):
          self._report(name, f'timed out after {self.timeout_s:g} s', None)
          return 'timeout', None
        continue
      # Queued: every earlier call has started. With no live worker left
      # (MAX_ABANDONED reached) it would never run.
      if pool.live <= 0 and fut.cancel():
        self._report(name, 'timed out (no free worker)', None)
        return 'timeout', None
      concurrent.futures.wait([fut], timeout=min(0.01, self.timeout_s))

  def close(self) -> None:
    """Stops the idle workers (abandoned ones end when their call does)."""
    with self._pool_lock:
      if self._pool is not None:
        self._pool.close()
        self._pool = None


def _result(fut: concurrent.futures.Future) -> tuple[Any, BaseException | None]:
  exc = fut.exception()
  return (None, exc) if exc is not None else (fut.result(), None)
