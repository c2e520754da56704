"""Metric output: metrics.jsonl, the loggers' sinks, and a progress line.

`MetricWriter` appends one JSON object per step to `<workdir>/metrics.jsonl`:

    {"step": 12, "reward/mean": 0.53125, "actor/clipfrac": 0.0, ...}

`step` comes first, then the metrics in the order given. Integer metrics stay
integers, everything else is a float, and a non-finite value (NaN, ±inf) is
written as `null`: `NaN` and `Infinity` are not JSON, and strict parsers
(JavaScript's `JSON.parse`, Go's `encoding/json`, ...) reject a file
holding them.
`read_metrics` turns `null` back into NaN. Every line is flushed when
written; a line cut short by a crash is dropped when the file is reopened.

On resume the trainer calls `resume(step)`: lines of steps after the
restored checkpoint are dropped (`truncate_after`: a new file is written and
renamed over the old one, so a crash never leaves half a file), and the
resumed run appends from there, so every step appears once. At step 0 the
step-0 line goes too: its evaluation follows checkpoint 0 and runs again.

Every other logger of `train.loggers` (TensorBoard, W&B, MLflow:
jaxcorr/train/tracker/sinks.py) is a `Sink` the writer hands the same
values after the line is written; `truncate_after(step)` tells each one
that the run restarted after `step` (TensorBoard then discards the points of
later steps that the interrupted run had logged). A sink that raises is
logged as a warning and dropped: a logger never stops training.

`MetricWriter(enabled=False)` (every process but the first) writes nothing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import jax
import numpy as np
from absl import logging

from jaxcorr.train.tracker.sinks import Sink
from jaxcorr.train.tracker.step_rate import StepRate, compile_seconds

JSONL = 'metrics.jsonl'

# ---------------------------------------------------------------- scalars


def _scalar(key: str, value: Any) -> int | float:
  a = np.asarray(value)
  if a.shape != ():
    raise ValueError(
      f'metric {key!r} must be a scalar, got shape {a.shape}; reduce it '
      'before logging'
    )
  if a.dtype.kind in 'biu':
    return int(a)
  if a.dtype.kind in 'fV':  # 'V': ml_dtypes (bfloat16, float8, ...)
    try:
      return float(a)
    except (TypeError, ValueError):
      pass
  raise ValueError(
    f'metric {key!r} must be a real number, got {value!r} of dtype {a.dtype}'
  )


def to_host_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
  """Python numbers of a dict of scalar metrics, fetched with one
  `jax.device_get` for the whole dict.

  Integer and bool values become `int`, floating ones `float`; a value that
  is not a scalar (shape other than `()`) or not a real number raises a
  ValueError naming its key.
  """
  for key in metrics:
    if not isinstance(key, str):
      raise ValueError(f'metric keys must be str, got {key!r}')
  host = jax.device_get(dict(metrics))
  return {k: _scalar(k, host[k]) for k in metrics}


def _json_value(x: int | float) -> int | float | None:
  if isinstance(x, float) and not math.isfinite(x):
    return None
  return x


def read_metrics(path: str) -> list[dict[str, Any]]:
  """The records of a metrics.jsonl file (or of `<path>/metrics.jsonl` when
  `path` is a directory), in file order; `null` values read as NaN.

  A last line without its newline (a write cut short) is skipped; any other
  line that is not a JSON object raises a ValueError naming its number.
  """
  if os.path.isdir(path):
    path = os.path.join(path, JSONL)
  with open(path, encoding='utf-8') as f:
    text = f.read()
  # The last piece is '' for a well-formed file, else a line cut short.
  complete = text.split('\n')[:-1]
  out = []
  for i, line in enumerate(complete, 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f'{path}:{i}: not a JSON line ({e})') from None
    if not isinstance(record, dict):
      raise ValueError(f'{path}:{i}: not a JSON object')
    out.append({k: math.nan if v is None else v for k, v in record.items()})
  return out


# ----------------------------------------------------------------- writer


def _drop_partial_tail(path: str) -> None:
  """Cut a last line that has no newline (a write killed mid-line)."""
  if not os.path.exists(path):
    return
  with open(path, 'rb+') as f:
    size = f.seek(0, os.SEEK_END)
    if size == 0:
      return
    f.seek(size - 1)
    if f.read(1) == b'\n':
      return
    f.seek(0)
    data = f.read()
    f.truncate(data.rfind(b'\n') + 1)


class MetricWriter:
  """metrics.jsonl writer that fans each step out to the sinks (module
  doc).

  Args:
    workdir: the run directory; created if missing.
    sinks: the other loggers (`sinks.open_sinks`); the writer closes them.
    enabled: False makes every method a no-op (non-primary processes).
  """

  def __init__(
    self,
    workdir: str,
    *,
    sinks: Sequence[Sink] = (),
    enabled: bool = True,
  ):
    self.workdir = workdir
    self.path = os.path.join(workdir, JSONL)
    self.enabled = bool(enabled)
    self._jsonl: TextIO | None = None
    self.sinks: list[Sink] = list(sinks) if self.enabled else []
    self._closed = False
    if not self.enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    _drop_partial_tail(self.path)
    self._jsonl = open(self.path, 'a', encoding='utf-8')  # noqa: SIM115

  def _each_sink(self, what: str, call) -> None:
    """`call(sink)` for every sink; one that raises is dropped."""
    for sink in list(self.sinks):
      try:
        call(sink)
      except Exception as e:  # a logger never stops a run
        logging.warning('logger %s disabled: %s failed: %r', sink.name, what, e)
        self.sinks.remove(sink)
        with contextlib.suppress(Exception):  # already reported
          sink.close()

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    """Append the metrics of `step` (scalars: Python, NumPy or JAX).

    A `step` key in `metrics` must equal `step`; it is written once, first.
    """
    if self._closed:
      raise ValueError(f'MetricWriter of {self.workdir} is closed')
    if isinstance(step, bool) or not isinstance(step, int | np.integer):
      raise ValueError(f'step must be an int, got {step!r}')
    if not self.enabled:
      return
    step = int(step)
    values = to_host_scalars(metrics)
    if 'step' in values and values.pop('step') != step:
      raise ValueError(
        f'metrics["step"]={metrics["step"]!r} differs from step={step}'
      )
    record = {'step': step}
    record.update((k, _json_value(v)) for k, v in values.items())
    assert self._jsonl is not None
    self._jsonl.write(json.dumps(record, allow_nan=False) + '\n')
    self._jsonl.flush()
    floats = {k: float(v) for k, v in values.items()}
    self._each_sink(f'write of step {step}', lambda s: s.write(step, floats))

  def resume(self, step: int) -> None:
    """Before a run resumed from checkpoint `step` (0: none, or the one
    after the SFT warm-up) writes: drop the lines it writes again, so each
    step appears once. Those after `step`, and at 0 also step 0's, the
    evaluation that follows checkpoint 0."""
    self.truncate_after(step if step > 0 else -1)

  def truncate_after(self, step: int) -> None:
    """Drop the lines of steps after `step` (resume from checkpoint `step`).

    The kept lines are written to a temporary file that replaces
    metrics.jsonl with one rename; then every sink's `restart(step)`
    (TensorBoard: a `SessionLog.START` at `step + 1`, which makes it
    discard the old points from there on).
    """
    if self._closed:
      raise ValueError(f'MetricWriter of {self.workdir} is closed')
    if not self.enabled:
      return
    assert self._jsonl is not None
    self._jsonl.close()
    kept = []
    with open(self.path, encoding='utf-8') as f:
      for line in f:
        if not line.endswith('\n'):
          continue  # cut short
        try:
          record = json.loads(line)
        except json.JSONDecodeError:
          continue
        if isinstance(record, dict) and record.get('step', math.inf) <= step:
          kept.append(line)
    fd, tmp = tempfile.mkstemp(
      prefix=f'.{JSONL}.', suffix='.tmp', dir=self.workdir
    )
    try:
      with os.fdopen(fd, 'w', encoding='utf-8') as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, self.path)
    except BaseException:
      if os.path.exists(tmp):
        os.remove(tmp)
      raise
    finally:
      self._jsonl = open(self.path, 'a', encoding='utf-8')  # noqa: SIM115
    self._each_sink('restart', lambda s: s.restart(step))

  def close(self) -> None:
    """Close the files (idempotent)."""
    if self._closed:
      return
    self._closed = True
    if self._jsonl is not None:
      self._jsonl.close()
    self._each_sink('close', lambda s: s.close())
    self.sinks = []

  def __enter__(self) -> MetricWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


# --------------------------------------------------------------- progress


def format_duration(seconds: float) -> str:
  """'45s', '1m48s', '2h03m' (rounded to the second)."""
  s = max(round(seconds), 0)
  if s < 60:
    return f'{s}s'
  if s < 3600:
    return f'{s // 60}m{s % 60:02d}s'
  return f'{s // 3600}h{s % 3600 // 60:02d}m'


def _format_value(x: Any) -> str:
  try:
    return f'{float(np.asarray(x)):.4g}'
  except (TypeError, ValueError):
    return str(x)


class ProgressLine:
  """One human-readable line per logged step:

      step 12/100 | reward/mean 0.531 | 1.23 s/step | ETA 1m48s

  Seconds per step and the ETA come from `step_rate.StepRate`: the first
  step and the steps that mostly compiled (`step_rate.compile_seconds`, in
  every thread) are left out, and from the others their compile time, so
  the line shows them from the first step that did not compile on.

  Args:
    total_steps: the last step.
    keys: metrics to show, in order; missing ones are left out.
    stream: where to print (default: `sys.stderr` at the time of printing).
    every: print when `step % every == 0`, and at the last step.
    smoothing: the moving average's weight on the newest step time.
    compile_steps: leading step times left out of the rate.
    enabled: print at all; default: only on process 0 (`update` still
      returns the line elsewhere).
    label: what is counted, first on the line (the eval progress of
      `jaxcorr.train.evaluation`: 'eval/add sampled prompts').
    unit: the rate's unit, `s/<unit>`.
  """

  def __init__(
    self,
    total_steps: int,
    *,
    keys: Sequence[str] = ('reward/mean',),
    stream: TextIO | None = None,
    every: int = 1,
    smoothing: float = 0.1,
    compile_steps: int = 1,
    enabled: bool | None = None,
    label: str = 'step',
    unit: str = 'step',
  ):
    if every < 1:
      raise ValueError(f'every must be >= 1, got {every}')
    self.total_steps = int(total_steps)
    self.keys = tuple(keys)
    self.label, self.unit = label, unit
    self.stream = stream
    self.every = every
    self.rate = StepRate(smoothing=smoothing, compile_steps=compile_steps)
    # (step, compile seconds) at the last update.
    self._last: tuple[int | None, float] = (None, compile_seconds())
    self.enabled = jax.process_index() == 0 if enabled is None else enabled

  @property
  def seconds_per_step(self) -> float | None:
    return self.rate.value

  def update(
    self,
    step: int,
    metrics: Mapping[str, Any],
    seconds_per_step: float | None = None,
  ) -> str | None:
    """Record a step time and print the line if `step` is due; returns the
    printed line (None when not due)."""
    compiled = compile_seconds()
    last_step, last_compiled = self._last
    self._last = (step, compiled)
    if seconds_per_step is not None:
      # The compile time since the last update, spread over its steps.
      steps = max(step - last_step, 1) if last_step is not None else 1
      self.rate.add(seconds_per_step, (compiled - last_compiled) / steps)
    if step % self.every and step != self.total_steps:
      return None
    parts = [f'{self.label} {step}/{self.total_steps}']
    parts += [
      f'{k} {_format_value(metrics[k])}' for k in self.keys if k in metrics
    ]
    eta = self.rate.eta(self.total_steps - step)
    if eta is not None:
      parts.append(f'{self.rate.value:.3g} s/{self.unit}')
      parts.append(f'ETA {format_duration(eta)}')
    line = ' | '.join(parts)
    if self.enabled:
      stream = sys.stderr if self.stream is None else self.stream
      print(line, file=stream, flush=True)
    return line
