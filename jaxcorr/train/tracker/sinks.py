"""The loggers of `train.loggers`: where metrics go besides metrics.jsonl.

`train.loggers` is a comma list of `LOGGERS`:

    tensorboard  event files under `<workdir>/tensorboard/` (the default;
                 jaxcorr/train/tracker/tensorboard.py, no TensorFlow)
    jsonl        `<workdir>/metrics.jsonl`: always written, whatever the
                 list says (resume truncates it and reads it back, so it is
                 the run's record); `'jsonl'` alone means no other logger
    wandb        a Weights & Biases run (`pip install jaxcorr[wandb]`;
                 jaxcorr/train/tracker/wandb_sink.py)
    mlflow       an MLflow run (`pip install jaxcorr[mlflow]`;
                 jaxcorr/train/tracker/mlflow_sink.py)

Every sink gets the same `{name: float}` dict per step that metrics.jsonl
records and implements `Sink`. The run's config is logged once, when the
sink's run is created. A sink that raises, when it is opened or on a
write, is logged as a warning and dropped (`open_sinks`,
`metrics.MetricWriter`): a logger never stops training. The MLflow sink
opens and writes on a thread of its own (`background.Background`): an
unreachable tracking server never delays training, and its warning names
the tracking URI. A logger whose
package is not installed is a start-up error naming the extra to install
(`check_installed`, called by `jaxcorr.train.build`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from absl import logging

from jaxcorr.config.fields import Invalid, fail
from jaxcorr.train.tracker.background import Background
from jaxcorr.train.tracker.tensorboard import TensorBoardSink

LOGGERS = ('tensorboard', 'jsonl', 'wandb', 'mlflow')

# logger -> (the module it imports, the extra that installs it)
EXTRAS = {'wandb': ('wandb', 'wandb'), 'mlflow': ('mlflow', 'mlflow')}

# Run ids of the wandb / mlflow runs of a workdir: a resumed run logs to
# the run it started.
RUN_IDS = 'logger_runs.json'
_RUN_IDS_LOCK = threading.Lock()


class Sink(Protocol):
  """One logger's end of `MetricWriter` (module doc)."""

  name: str

  def write(self, step: int, values: Mapping[str, float]) -> None:
    """The metrics of `step`, as metrics.jsonl records them (NaN, not
    null)."""

  def restart(self, step: int) -> None:
    """The run resumed from checkpoint `step`; later steps follow."""

  def close(self) -> None:
    """Flush and finish (called once)."""


def logger_names(spec: str) -> tuple[str, ...]:
  """`'tensorboard, wandb'` -> `('tensorboard', 'wandb')` (unchecked)."""
  return tuple(p.strip() for p in spec.split(',') if p.strip())


def loggers_rule(value: Any, path: str) -> str:
  """The `train.loggers` rule: a comma list of distinct `LOGGERS`, at least
  one; stored canonical (`'tensorboard,wandb'`)."""
  allowed = (
    'a comma list of ' + ', '.join(repr(n) for n in LOGGERS) + ' (e.g. '
    "'tensorboard,wandb'; 'jsonl' alone: metrics.jsonl only)"
  )
  if not isinstance(value, str):
    raise Invalid(allowed, 'not a string')
  names = logger_names(value)
  if not names:
    raise Invalid(allowed, 'empty')
  unknown = [n for n in names if n not in LOGGERS]
  if unknown:
    raise Invalid(allowed, f'unknown: {", ".join(unknown)}')
  if len(set(names)) != len(names):
    raise Invalid(allowed, 'a logger named twice')
  return ','.join(names)


def check_installed(
  spec: str, path: str = 'config.train.loggers', find=importlib.util.find_spec
) -> None:
  """A ValueError naming the extra when a logger's package is missing."""
  for name in logger_names(spec):
    if name in EXTRAS and find(EXTRAS[name][0]) is None:
      module, extra = EXTRAS[name]
      fail(
        path,
        spec,
        f'loggers whose package is installed: {name!r} needs the '
        f'{module!r} package: pip install "jaxcorr[{extra}]"',
        f'{module!r} is not installed',
      )


def _run_ids(workdir: str) -> dict[str, str]:
  path = os.path.join(workdir, RUN_IDS)
  if not os.path.exists(path):
    return {}
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def _save_run_id(workdir: str, name: str, run_id: str) -> None:
  with _RUN_IDS_LOCK:  # loggers open on threads of their own
    ids = _run_ids(workdir)
    if ids.get(name) == run_id:
      return
    ids[name] = run_id
    tmp = os.path.join(workdir, f'.{RUN_IDS}.tmp')
    with open(tmp, 'w', encoding='utf-8') as f:
      json.dump(ids, f, indent=2)
    os.replace(tmp, os.path.join(workdir, RUN_IDS))


def open_sinks(
  spec: str,
  workdir: str,
  *,
  config: Mapping[str, Any],
  project: str = 'jaxcorr',
  run_name: str = '',
  wandb_entity: str = '',
  mlflow_tracking_uri: str = '',
) -> list[Sink]:
  """The sinks of `spec` (`train.loggers`) for the run in `workdir`.

  Args:
    spec: the comma list; `jsonl` opens nothing (MetricWriter writes it).
    workdir: the run directory (created if missing).
    config: the run's config as JSON values, logged once per logger run.
    project: the W&B project and the MLflow experiment.
    run_name: the W&B / MLflow run name ('' : the workdir's basename).
    wandb_entity: the W&B entity ('' : W&B's default).
    mlflow_tracking_uri: '' : `MLFLOW_TRACKING_URI`, else a file store
      under `<workdir>/mlruns`.

  A sink that raises while opening is a warning and is left out.
  """
  os.makedirs(workdir, exist_ok=True)
  name = run_name or os.path.basename(os.path.normpath(workdir))
  ids = _run_ids(workdir)

  def remember(logger: str) -> Callable[[str], None]:
    return lambda run_id: _save_run_id(workdir, logger, run_id)

  openers: dict[str, Callable[[], Sink]] = {}
  for logger in logger_names(spec):
    if logger == 'tensorboard':
      openers[logger] = lambda: TensorBoardSink(workdir)
    elif logger == 'wandb':
      from jaxcorr.train.tracker.wandb_sink import WandbSink

      openers[logger] = lambda: WandbSink(
        workdir,
        config=config,
        project=project,
        name=name,
        entity=wandb_entity,
        run_id=ids.get('wandb'),
        on_run_id=remember('wandb'),
      )
    elif logger == 'mlflow':
      from jaxcorr.train.tracker.mlflow_sink import MlflowSink, tracking_uri

      openers[logger] = lambda: Background(
        'mlflow',
        f'tracking URI {tracking_uri(workdir, mlflow_tracking_uri)}',
        lambda: MlflowSink(
          workdir,
          config=config,
          experiment=project,
          name=name,
          uri=mlflow_tracking_uri,
          run_id=ids.get('mlflow'),
          on_run_id=remember('mlflow'),
        ),
      )
  return open_each(openers.items())


def open_each(openers: Sequence[tuple[str, Callable[[], Sink]]]) -> list[Sink]:
  """Calls each opener; one that raises is a warning and is left out."""
  out = []
  for logger, opener in openers:
    try:
      out.append(opener())
    except Exception as e:  # a logger never stops a run
      logging.warning('logger %s disabled: it failed to start: %r', logger, e)
  return out
