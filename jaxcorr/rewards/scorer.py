"""`RewardScorer`: the weighted sum of named rewards, contained.

Rewards are user code running inside the training loop, so the scorer
contains them: a call that raises, returns something that is not a finite
float32 (a bool is 0 or 1), or runs past `timeout_s` scores 0 for that
function on that row and is counted; `score` never waits longer than
`step_budget_s`. A function that fails (raises or returns a non-number) on
more than `max_failure_fraction` of its rows in `FAILING_SCORES`
consecutive `score` calls is a bug, not bad luck: `score` then raises
`RewardFunctionFailing` naming it and its first failure, so a run does not
go on training on zeros.

`isolation` picks where calls run. 'thread' (default): on `WorkerPool`
threads, so a call that hangs is abandoned and replaced, and later calls
(other functions, the evaluation) get fresh workers. A function with
`MAX_STUCK` abandoned calls still running gets no new ones until some
return (its rows score 0, counted in `reward/timeouts`), which bounds the
threads it can hold. Threads bound Python-level slowness and blocking I/O;
a C extension that holds the GIL (a pathological `re` match) stalls the
whole process, SIGTERM handling included. 'process': on
`jaxcorr.rewards.processes.ProcessPool` workers, which are killed and
replaced when a call times out, so no call can stall the trainer; it costs
worker start-up (seconds, again after each kill), memory per worker and
pickling, and needs the functions registered at import of their module
(that module's doc).

Values are checked in float32, the dtype the update uses: a reward of 1e39
is finite in float64 but inf in float32, so it is a failure of the function
that returned it; a weighted sum that overflows float32 scores 0 on its row
and counts as a failure too. `check_rewards` applies the same check to any
rewards array before the update, naming the rewards as the cause.

A stop (SIGTERM, Ctrl-C) must not wait out the step budget: while the
trainer runs it sets `stop_requested`, and once that returns True the calls
still unfinished get `STOP_GRACE_S` more seconds, then score 0 as if the
budget had run out, so the step ends, its checkpoint is written and the run
exits within the preemption's grace period.

A stop (`stop_requested`) or the step budget, whichever comes first, is what
the log line of a call cut short names; `timeout_s` and `step_budget_s` of
0 (None) mean no limit, and a stop still cuts the calls after the grace.

Metrics (per step, summed over rows; docs/data_and_rewards.md):
`reward/failures` (raised, not a number, not finite in float32),
`reward/timeouts` (past `timeout_s`, past the step budget, or skipped for
`MAX_STUCK`), `reward/stuck_calls` (abandoned calls still running),
`reward/budget_exceeded` (1 when the step budget cut the scoring short),
`reward/<name>/mean`, and `reward/<name>/outcome/<reason>`: the rows whose
call returned an `Outcome` with that reason (a sandboxed run's 'passed',
'timeout', 'memory', ...: jaxcorr/sandbox/).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import numbers
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxcorr.config import fields
from jaxcorr.rewards.config import RewardConfig
from jaxcorr.rewards.processes import ProcessPool
from jaxcorr.rewards.registry import _SPEC, REWARDS, Outcome, parse_spec
from jaxcorr.rewards.workers import Task, WorkerPool

# Abandoned calls of one function that may still be running before the
# scorer stops giving it new ones (module doc).
MAX_STUCK = 64

# Seconds `score` still waits once `stop_requested()` is true (SIGTERM,
# Ctrl-C): enough for healthy calls in flight, far less than a preemption's
# grace period (about 30 s), which a hanging call would otherwise use up.
STOP_GRACE_S = 2.0

# Consecutive `score` calls in which one function fails on more than
# `max_failure_fraction` of its rows before `score` raises: one bad batch
# (a flaky verifier) is tolerated, a function that cannot work is not.
FAILING_SCORES = 3

ISOLATIONS = ('thread', 'process')

_F32_MAX = float(np.finfo(np.float32).max)
_log = logging.getLogger(__name__)


class RewardFunctionFailing(RuntimeError):
  """A reward function failed on (nearly) every row of several batches."""


def _valid(value: Any) -> float | None:
  """A reward value as a float finite in float32 (a bool as 0 or 1), or
  None."""
  if (
    isinstance(value, np.ndarray)
    and value.ndim == 0
    and value.dtype.kind in 'biuf'
  ):
    value = value.item()
  if isinstance(value, bool | np.bool_):
    return float(value)
  if not isinstance(value, numbers.Real):
    return None
  value = float(value)
  return value if math.isfinite(value) and abs(value) <= _F32_MAX else None


def check_rewards(rewards: Any, dtype: Any = np.float32) -> np.ndarray:
  """`rewards` cast to `dtype` (the update's); ValueError naming the rows
  when a value is not finite there (a reward too large for the dtype would
  otherwise surface as a NaN loss blamed on log-probs)."""
  raw = np.asarray(rewards)
  with np.errstate(over='ignore', invalid='ignore'):
    cast = raw.astype(dtype)
  bad = np.flatnonzero(~np.isfinite(cast))
  if bad.size:
    raise ValueError(
      f'rewards: {bad.size} of {cast.size} are not finite in {np.dtype(dtype)}'
      f' (the update dtype), e.g. row {bad[0]} = {raw.reshape(-1)[bad[0]]};'
      ' check the reward functions (config.reward.functions) and weights'
    )
  return cast


def _positive_or_none(path: str, value: Any) -> float | None:
  if value is None:
    return None
  if isinstance(value, bool) or _valid(value) is None or value < 0:
    raise ValueError(
      f'{path}: invalid value {value!r}; allowed: a finite number >= 0 '
      '(0: none)'
    )
  return float(value) or None


class FailureWatch:
  """Stops a run whose reward function fails on (nearly) every row: more
  than `max_fraction` of its rows in `FAILING_SCORES` consecutive batches
  (module doc). Keeps each function's first failure for the message."""

  def __init__(self, names: Sequence[str], max_fraction: float):
    self.names = tuple(names)
    self.max_fraction = fields.check(
      fields.number(0, 1), max_fraction, 'config.reward.max_failure_fraction'
    )
    self.first: dict[str, str] = {}
    self._runs = [0] * len(self.names)

  def note(self, name: str, what: str) -> None:
    """Records a failure ('raised ...', 'returned ...') of `name`."""
    self.first.setdefault(name, what)

  def check(self, failed: np.ndarray, n: int) -> None:
    """After a batch of `n` rows with `failed[j]` failures of function j:
    raises `RewardFunctionFailing` on the `FAILING_SCORES`-th such batch in
    a row."""
    if not n:
      return
    for j, name in enumerate(self.names):
      over = failed[j] / n > self.max_fraction
      self._runs[j] = self._runs[j] + 1 if over else 0
      if self._runs[j] >= FAILING_SCORES:
        raise RewardFunctionFailing(
          f'reward {name!r} failed on more than '
          f'config.reward.max_failure_fraction={self.max_fraction:g} of its '
          f'rows in {FAILING_SCORES} batches in a row ({failed[j]} of {n} in '
          f'the last); its first failure: {self.first.get(name, "?")}. Fix '
          'the function (it must return a number), or set '
          'config.reward.max_failure_fraction=1 to score its failures 0 and '
          'go on'
        )


def _known() -> str:
  return ', '.join(repr(n) for n in sorted(REWARDS))


def check_spec(
  spec: Sequence[tuple[str, float]],
) -> tuple[tuple[str, ...], tuple[float, ...]]:
  """(names, weights) of a reward spec (`parse_spec`'s pairs); ValueError
  naming `config.reward.functions` when it is empty, names a function not
  registered in `REWARDS` now, names one twice, or has a weight that is not
  a finite number. `RewardScorer` runs it, and so does the start-up check
  of `jaxcorr.train.build` (before any device work)."""
  spec = list(spec)
  if not spec:
    raise ValueError(f'{_SPEC}: no reward functions; allowed: {_known()}')
  names = tuple(name for name, _ in spec)
  for name in names:
    if name not in REWARDS:
      raise ValueError(
        f'{_SPEC}: unknown reward {name!r}; registered: {_known()} '
        '(register more with jaxcorr.rewards.register)'
      )
  dupes = sorted({n for n in names if names.count(n) > 1})
  if dupes:
    raise ValueError(
      f'{_SPEC}: reward(s) {", ".join(map(repr, dupes))} listed more than '
      'once; allowed: each name once (add the weights)'
    )
  weights = []
  for name, weight in spec:
    w = None if isinstance(weight, bool | np.bool_) else _valid(weight)
    if w is None:
      raise ValueError(
        f'{_SPEC}: invalid weight {weight!r} for {name!r}; allowed: a '
        'finite number'
      )
    weights.append(w)
  return names, tuple(weights)


class RewardScorer:
  """The weighted sum of named rewards, one float32 per row (module doc).

  Args:
    spec: (name, weight) pairs, e.g. `parse_spec(config.reward.functions)`;
      names must be registered in `REWARDS` now.
    timeout_s: seconds one (function, row) call may run, from its start;
      None or 0: no per-call limit (the step budget still applies).
    step_budget_s: seconds one `score` call may take in all; calls still
      unfinished then score 0 (counted in `reward/timeouts`). None or 0:
      no budget.
    max_workers: threads (or processes) running calls concurrently.
    isolation: 'thread' or 'process' (module doc).
    max_failure_fraction: in [0, 1]; a function failing on more than this
      fraction of its rows in `FAILING_SCORES` consecutive `score` calls
      raises `RewardFunctionFailing`. 1: never.
  """

  @classmethod
  def from_config(cls, cfg: RewardConfig) -> RewardScorer:
    """The scorer of the run's `reward` section."""
    return cls(
      parse_spec(cfg.functions),
      timeout_s=cfg.timeout_s,
      step_budget_s=cfg.step_budget_s,
      isolation=cfg.isolation,
      max_failure_fraction=cfg.max_failure_fraction,
    )

  def __init__(
    self,
    spec: Sequence[tuple[str, float]],
    *,
    timeout_s: float | None = 5.0,
    step_budget_s: float | None = 300.0,
    max_workers: int = 4,
    isolation: str = 'thread',
    max_failure_fraction: float = 0.9,
  ):
    names, weights = check_spec(spec)
    self.timeout_s = _positive_or_none('config.reward.timeout_s', timeout_s)
    self.step_budget_s = _positive_or_none(
      'config.reward.step_budget_s', step_budget_s
    )
    fields.check(fields.integer(1), max_workers, 'RewardScorer max_workers')
    self.isolation = fields.check(
      fields.one_of(*ISOLATIONS), isolation, 'config.reward.isolation'
    )
    self.names = tuple(names)
    self.weights = np.asarray(weights, np.float64)
    self._fns = tuple(REWARDS[n] for n in names)
    self.max_workers = max_workers
    self._pool: WorkerPool | ProcessPool | None = None
    self._pool_lock = threading.Lock()
    self._warned: set[str] = set()
    self._watch = FailureWatch(self.names, max_failure_fraction)
    # Set by the trainer while it runs (module doc): a stop cuts the wait.
    self.stop_requested: Callable[[], bool] | None = None

  def __repr__(self) -> str:
    spec = ','.join(f'{n}:{w:g}' for n, w in zip(self.names, self.weights))
    return (
      f'RewardScorer({spec!r}, timeout_s={self.timeout_s}, '
      f'step_budget_s={self.step_budget_s})'
    )

  def _report(self, name: str, what: str, exc: BaseException | None) -> None:
    """Logs the first failure of each function (later ones only count)."""
    if not what.startswith('timed out'):
      self._watch.note(name, what)
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
    self,
    name: str,
    fut: concurrent.futures.Future,
    reasons: collections.Counter,
  ) -> float | None:
    """The call's value, or None after reporting why it failed; an
    `Outcome`'s reason is counted in `reasons`."""
    exc = fut.exception()
    if exc is not None:
      self._report(name, f'raised {type(exc).__name__}: {exc}', exc)
      return None
    value = fut.result()
    if isinstance(value, Outcome):
      reasons[f'reward/{name}/outcome/{value.reason}'] += 1
      value = value.value
    v = _valid(value)
    if v is None:
      self._report(name, f'returned {value!r}, not a finite float32', None)
    return v

  def score(
    self, responses: Sequence[str], answers: Sequence[str]
  ) -> tuple[np.ndarray, dict[str, float]]:
    """(rewards float32 [B], metrics). Raises for mismatched lengths (a
    caller bug) and `RewardFunctionFailing` (class doc); other
    reward-function errors score 0 and are counted."""
    rewards, metrics, _ = self.score_each(responses, answers)
    return rewards, metrics

  def score_each(
    self, responses: Sequence[str], answers: Sequence[str]
  ) -> tuple[np.ndarray, dict[str, float], np.ndarray]:
    """`score`, plus each function's unweighted value of each row,
    float64 `[F, B]` in `names` order (0 where a call failed or timed
    out); evaluation reads the first function's."""
    if isinstance(responses, str) or isinstance(answers, str):
      raise ValueError('RewardScorer.score: pass sequences of strings')
    if len(responses) != len(answers):
      raise ValueError(
        f'RewardScorer.score: {len(responses)} responses but '
        f'{len(answers)} answers'
      )
    n = len(responses)
    values = np.zeros((len(self._fns), n), np.float64)
    start = time.monotonic()
    deadline = start + self.step_budget_s if self.step_budget_s else math.inf
    # What cut the unfinished calls short at `deadline` (for the log).
    cut_by = (
      f'step budget {self.step_budget_s:g} s' if self.step_budget_s else ''
    )
    pool = self._get_pool()
    pending: dict[Task, tuple[int, int]] = {}
    timeouts = 0
    failed = np.zeros(len(self._fns), np.int64)
    reasons: collections.Counter = collections.Counter()
    for j, (name, fn) in enumerate(zip(self.names, self._fns)):
      if pool.stuck(name) >= MAX_STUCK:
        self._report(name, f'timed out: {MAX_STUCK} calls still hang', None)
        timeouts += n
        continue
      for i in range(n):
        pending[pool.submit(name, fn, responses[i], answers[i])] = (j, i)
    budget_exceeded = False
    while pending:
      now = time.monotonic()
      stopping = self.stop_requested is not None and self.stop_requested()
      if stopping and now + STOP_GRACE_S < deadline:
        deadline = now + STOP_GRACE_S
        cut_by = (
          f'the run is stopping (SIGTERM or Ctrl-C; {STOP_GRACE_S:g} s grace)'
        )
      wake = deadline
      for task in list(pending):
        j, i = pending[task]
        name = self.names[j]
        if task.future.done():
          del pending[task]
          v = self._outcome(name, task.future, reasons)
          if v is None:
            failed[j] += 1
          else:
            values[j, i] = v
        elif now >= deadline:
          budget_exceeded = True
          if pool.abandon(task):
            del pending[task]
            timeouts += 1
            self._report(name, f'timed out: {cut_by}', None)
        elif self.timeout_s and task.start is not None:
          expiry = task.start + self.timeout_s
          if now >= expiry and pool.abandon(task):
            del pending[task]
            timeouts += 1
            self._report(name, f'timed out after {self.timeout_s:g} s', None)
          else:
            wake = min(wake, expiry)
      if pending:
        wait = min(max(wake - time.monotonic(), 0.0), 0.05)
        concurrent.futures.wait(
          [t.future for t in pending],
          timeout=wait,
          return_when=concurrent.futures.FIRST_COMPLETED,
        )
    self._watch.check(failed, n)
    rewards, metrics = self._combine(
      values, int(failed.sum()), timeouts, budget_exceeded, pool.stuck()
    )
    metrics.update((k, float(v)) for k, v in sorted(reasons.items()))
    return rewards, metrics, values

  def _combine(
    self,
    values: np.ndarray,
    failures: int,
    timeouts: int,
    budget_exceeded: bool,
    stuck: int,
  ) -> tuple[np.ndarray, dict[str, float]]:
    """The weighted rewards of per-function `values` [F, B] (an overflowing
    sum scores 0 and counts as a failure) and the `reward/` metrics."""
    n = values.shape[1]
    rewards = (self.weights[:, None] * values).sum(axis=0)
    overflow = np.abs(rewards) > _F32_MAX
    if overflow.any():
      _log.warning(
        'reward: %d weighted sums overflow float32 (scored 0; counted in '
        'reward/failures)',
        int(overflow.sum()),
      )
      rewards[overflow] = 0.0
      failures += int(overflow.sum())
    metrics = {
      'reward/failures': float(failures),
      'reward/timeouts': float(timeouts),
      'reward/stuck_calls': float(stuck),
      'reward/budget_exceeded': float(budget_exceeded),
    }
    for j, name in enumerate(self.names):
      metrics[f'reward/{name}/mean'] = float(values[j].mean()) if n else 0.0
    return rewards.astype(np.float32), metrics

  def start(self) -> None:
    """Starts the workers now rather than at the first `score` (with
    'process', a reward that a fresh process cannot find fails here)."""
    self._get_pool()

  def _get_pool(self) -> WorkerPool | ProcessPool:
    with self._pool_lock:
      if self._pool is None:
        if self.isolation == 'process':
          self._pool = ProcessPool(
            self.max_workers, dict(zip(self.names, self._fns))
          )
        else:
          self._pool = WorkerPool(self.max_workers)
        # Idle workers end with the scorer even without close().
        weakref.finalize(self, self._pool.close)
      return self._pool

  def close(self) -> None:
    """Stops the idle workers (abandoned ones end when their call does)."""
    with self._pool_lock:
      if self._pool is not None:
        self._pool.close()
        self._pool = None
