"""What the dashboard reads from a workdir (local or gs://, through
`etils.epath`), each answer a plain dict ready for JSON.

metrics.jsonl is read once and then tailed: `MetricsFile.refresh` reads
only the bytes appended since the last call (a page polling a live run
costs one `stat` when nothing changed), keeps the values as columns
(step list and value list per key), and starts over when the file was
rewritten (a resumed run truncates it: the last line read is no longer
where it was). A last line without its newline is a write in progress:
left for the next refresh, never an error. Trace and eval-sample files are
parsed once per (size, mtime).

Nothing here raises on a missing or half-written workdir: each run carries
a `status` ('ok', 'missing', 'empty') and the `notes` the page shows.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
import threading
from typing import Any

from etils import epath

from jaxcorr.train.evals import samples_log
from jaxcorr.train.tracker import traces
from jaxcorr.train.tracker.metrics import JSONL

_EVAL_FILE = re.compile(r'step_(\d+)\.jsonl$')


def _number(v: Any) -> float | None:
  """A JSON number of a metric (None: NaN, null, not a number)."""
  if isinstance(v, bool) or not isinstance(v, int | float):
    return None
  return float(v) if math.isfinite(v) else None


class MetricsFile:
  """metrics.jsonl of one workdir as columns, tailed (module doc)."""

  def __init__(self, workdir: epath.Path):
    self.path = workdir / JSONL
    self.lock = threading.Lock()
    self._reset()

  def _reset(self) -> None:
    self.offset = 0
    self.last_line = b''
    self.records: list[dict] = []  # the lines, 'step' popped
    self.keys: dict[str, None] = {}  # every key seen, in order
    # key -> (steps, values, [records consumed]): built on request.
    self.columns: dict[str, tuple[list, list, list[int]]] = {}
    self.steps: list[int] = []
    self.bad_lines = 0
    self.pending = False  # a last line still being written

  def refresh(self) -> None:
    with self.lock:
      if not self.path.exists():
        self._reset()
        return
      size = self.path.stat().length
      if size == self.offset and not self.pending:
        return  # nothing new: one stat per poll
      if size < self.offset:  # truncated (a resumed run)
        self._reset()
      back = len(self.last_line)
      with self.path.open('rb') as f:
        f.seek(self.offset - back)
        data = f.read()
      if back and not data.startswith(self.last_line):  # rewritten
        self._reset()
        with self.path.open('rb') as f:
          data = f.read()
        back = 0
      self._parse(data[back:])

  def _parse(self, data: bytes) -> None:
    end = data.rfind(b'\n') + 1
    self.pending = end < len(data)
    if not end:
      return
    lines = data[:end].split(b'\n')[:-1]
    self.offset += end
    self.last_line = lines[-1] + b'\n'
    for line in lines:
      if not line.strip():
        continue
      try:
        record = json.loads(line)
        step = int(record.pop('step'))
      except (ValueError, KeyError, TypeError, AttributeError):
        self.bad_lines += 1
        continue
      self.steps.append(step)
      self.records.append(record)
      self.keys.update(dict.fromkeys(record))

  def _column(self, key: str) -> tuple[list[int], list[float | None]]:
    """A key's (steps, values), built on its first request, then extended
    by the records appended since (a page asks for ~20 of ~100 keys)."""
    col = self.columns.get(key)
    if col is None:
      col = self.columns[key] = ([], [], [0])
    steps, values, done = col
    new = zip(self.steps[done[0] :], self.records[done[0] :], strict=True)
    for step, record in new:
      if key in record:
        steps.append(step)
        values.append(_number(record[key]))
    done[0] = len(self.records)
    return steps, values

  def _matching(self, patterns: list[str]) -> list[str]:
    return [
      k for k in self.keys if any(fnmatch.fnmatchcase(k, p) for p in patterns)
    ]

  def series(self, patterns: list[str]) -> dict[str, list[list]]:
    """{key: [steps, values]} of the keys matching any glob pattern."""
    with self.lock:
      return {
        k: [list(c) for c in self._column(k)] for k in self._matching(patterns)
      }

  def latest(self, patterns: list[str]) -> dict[str, float | None]:
    """The last value of each matching key."""
    with self.lock:
      return {k: self._column(k)[1][-1] for k in self._matching(patterns)}


class _Parsed:
  """One JSONL file parsed once per (size, mtime)."""

  def __init__(self):
    self.cache: dict[str, tuple[tuple, list[dict]]] = {}

  def rows(self, path: epath.Path) -> list[dict]:
    st = path.stat()
    stamp = (st.length, st.mtime)
    hit = self.cache.get(str(path))
    if hit is not None and hit[0] == stamp:
      return hit[1]
    text = path.read_text(encoding='utf-8')
    rows = []
    for line in text.split('\n'):
      try:
        rows.append(json.loads(line))
      except ValueError:
        continue  # '' or a line cut short
    self.cache[str(path)] = (stamp, rows)
    return rows


class Run:
  """One workdir of the dashboard."""

  def __init__(self, workdir: str, name: str):
    self.workdir = epath.Path(workdir)
    self.name = name
    self.metrics = MetricsFile(self.workdir)
    self._files = _Parsed()

  def status(self) -> dict[str, Any]:
    """`status` and the page's `notes` (module doc), after a refresh."""
    notes = []
    if not self.workdir.exists():
      return {
        'name': self.name,
        'workdir': str(self.workdir),
        'status': 'missing',
        'notes': [f'{self.workdir}: no such directory'],
      }
    self.metrics.refresh()
    m = self.metrics
    status = 'ok' if m.steps else 'empty'
    if not m.steps:
      notes.append(
        f'{m.path.name}: no metrics yet (the run has not logged a step)'
      )
    if m.pending:
      notes.append(f'{m.path.name}: the last line is being written (skipped)')
    if m.bad_lines:
      notes.append(f'{m.path.name}: {m.bad_lines} unreadable line(s) skipped')
    return {
      'name': self.name,
      'workdir': str(self.workdir),
      'status': status,
      'notes': notes,
      'last_step': m.steps[-1] if m.steps else None,
    }

  # ----------------------------------------------------------- traces

  def trace_steps(self) -> list[int]:
    return (
      traces.trace_steps(str(self.workdir)) if self.workdir.exists() else []
    )

  def trace_rows(self, step: int) -> list[dict]:
    return self._files.rows(traces.trace_path(str(self.workdir), step))

  # ----------------------------------------------------- eval samples

  def eval_steps(self) -> list[int]:
    folder = self.workdir / samples_log.DIRNAME
    if not folder.exists():
      return []
    found = (_EVAL_FILE.match(p.name) for p in folder.iterdir())
    return sorted(int(m.group(1)) for m in found if m)

  def eval_rows(self, step: int) -> list[dict]:
    folder = str(self.workdir / samples_log.DIRNAME)
    return self._files.rows(epath.Path(samples_log.path(folder, step)))


def row_summary(row: dict) -> dict[str, Any]:
  """A trace row without its token columns, with its mismatch: the mean
  and max |log π_old − log μ| over the policy's tokens (what the
  trajectory list sorts by)."""
  gaps = [
    abs(p - m)
    for p, m in zip(row.get('pi_old') or [], row.get('mu') or [])
    if p is not None and m is not None
  ]
  weights = [w for w in row.get('weight') or [] if w is not None]
  rejected = sum(r.endswith('rejected') for r in row.get('reason') or [])
  keep = ('row', 'group', 'sample', 'finish', 'prompt', 'reward', 'rewards')
  return {
    **{k: row.get(k) for k in keep},
    'tokens': len(row.get('ids') or []),
    'mismatch_mean': sum(gaps) / len(gaps) if gaps else 0.0,
    'mismatch_max': max(gaps, default=0.0),
    'weight_min': min(weights, default=None),
    'weight_max': max(weights, default=None),
    'rejected': rejected,
  }


def search_samples(
  rows: list[dict], query: str, limit: int
) -> tuple[int, list[dict]]:
  """(matches, the first `limit`): eval rows whose prompt, answer or reply
  holds `query` (case-insensitive; '' matches all)."""
  q = query.lower()
  hits = [
    r
    for r in rows
    if not q
    or any(
      q in str(r.get(k, '')).lower() for k in ('prompt', 'answer', 'reply')
    )
  ]
  return len(hits), hits[:limit]


def _quantiles(xs: list[float]) -> dict[str, float] | None:
  """p5, p50, p95 of `xs` (nearest rank), None when empty."""
  if not xs:
    return None
  xs = sorted(xs)
  pick = lambda q: xs[min(int(q * len(xs)), len(xs) - 1)]  # noqa: E731
  return {'p5': pick(0.05), 'p50': pick(0.5), 'p95': pick(0.95)}


def step_summary(rows: list[dict]) -> dict[str, Any]:
  """Over a trace step's trained tokens (reason ''): the quantiles of the
  correction weight and of log π_old − log μ, and the staleness histogram
  of the policy's tokens {staleness: tokens}; the metrics log no weight
  quantiles, the traces hold every traced weight."""
  weights, gaps, stale = [], [], {}
  for r in rows:
    cols = zip(
      r.get('reason') or [],
      r.get('weight') or [None] * len(r.get('reason') or []),
      r.get('pi_old') or [],
      r.get('mu') or [],
      r.get('staleness') or [],
      strict=False,
    )
    for why, w, p, m, st in cols:
      if st is not None:
        stale[st] = stale.get(st, 0) + 1
      if why:
        continue
      if w is not None:
        weights.append(w)
      if p is not None and m is not None:
        gaps.append(p - m)
  return {
    'weight': _quantiles(weights),
    'log_ratio': _quantiles(gaps),
    'staleness': {str(k): v for k, v in sorted(stale.items())},
  }
