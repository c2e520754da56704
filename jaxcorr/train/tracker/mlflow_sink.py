"""The `mlflow` logger: one MLflow run per workdir.

The tracking store is `train.mlflow_tracking_uri`, else
`MLFLOW_TRACKING_URI`, else a local file store, `file:<workdir>/mlruns`
(no server, no network; `mlflow ui --backend-store-uri <workdir>/mlruns`
shows it). MLflow 3 refuses a file store unless `MLFLOW_ALLOW_FILE_STORE`
is set; the sink sets it for a `file:` store that it was given or chose,
since that is what was asked for. `mlflow-skinny` (the `jaxcorr[mlflow]`
extra) holds the client and the file store; a database store needs the
full `mlflow` package.

The run config is logged once, as the run's params (flattened:
`train.seed`, `rollout.temperature`, ...), when the run is created; a
resumed workdir logs to the same run (its id is kept in
`<workdir>/logger_runs.json`) and leaves the params alone (MLflow params
cannot change). MLflow names may hold letters, digits and `_ - . / :` and
spaces: any other character of a metric name is written as `_`, and `@` as
`_at_` (`eval/pass@8` -> `eval/pass_at_8`), the one renaming of the
loggers (`mlflow_name`).

The sink runs on a thread of its own (`jaxcorr.train.tracker.background`,
opened by `sinks.open_sinks`): a server that refuses connections or never
answers delays no step. Its HTTP requests retry a bounded time, unless the
environment sets MLflow's variables: `HTTP_DEFAULTS` (2 retries, 10 s per
request), so a dead server is reported within about a minute rather than
MLflow's 4.5 minutes (refused) or never (silent).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

# Bounded retries (module doc); MLflow's own: 7 retries, 2 s backoff
# factor, 120 s per request.
HTTP_DEFAULTS = {
  'MLFLOW_HTTP_REQUEST_MAX_RETRIES': '2',
  'MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR': '1',
  'MLFLOW_HTTP_REQUEST_TIMEOUT': '10',
}
_MAX_PARAMS = 100  # per log_batch call
_MAX_METRICS = 1000
_MAX_VALUE = 6000  # characters of a param value
_NOT_ALLOWED = re.compile(r'[^\w./\- :]')


def mlflow_name(name: str) -> str:
  """The MLflow name of a metric (module doc)."""
  return _NOT_ALLOWED.sub('_', name.replace('@', '_at_'))


def _flatten(tree: Mapping[str, Any], prefix: str = '') -> Iterator[Any]:
  for key, value in tree.items():
    if isinstance(value, Mapping):
      yield from _flatten(value, f'{prefix}{key}.')
    else:
      yield f'{prefix}{key}', value


def tracking_uri(workdir: str, uri: str = '') -> str:
  """The store the sink logs to (module doc)."""
  uri = uri or os.environ.get('MLFLOW_TRACKING_URI', '')
  if not uri:
    uri = 'file:' + os.path.abspath(os.path.join(workdir, 'mlruns'))
  return uri


class MlflowSink:
  """A `jaxcorr.train.tracker.sinks.Sink` writing to an MLflow run."""

  name = 'mlflow'

  def __init__(
    self,
    workdir: str,
    *,
    config: Mapping[str, Any],
    experiment: str,
    name: str,
    uri: str = '',
    run_id: str | None = None,
    on_run_id: Callable[[str], None] | None = None,
  ):
    uri = tracking_uri(workdir, uri)
    if uri.startswith('file:'):
      os.environ.setdefault('MLFLOW_ALLOW_FILE_STORE', 'true')
    for var, value in HTTP_DEFAULTS.items():
      os.environ.setdefault(var, value)
    from mlflow.entities import Metric, Param, RunStatus
    from mlflow.tracking import MlflowClient

    self._metric, self._status = Metric, RunStatus
    self.client = MlflowClient(tracking_uri=uri)
    self.uri = uri
    if run_id is not None:
      self.run_id = self.client.get_run(run_id).info.run_id
      self.client.update_run(self.run_id, status='RUNNING')
    else:
      exp = self.client.get_experiment_by_name(experiment)
      exp_id = (
        exp.experiment_id
        if exp is not None
        else self.client.create_experiment(experiment)
      )
      self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
      params = [
        Param(k, str(v)[:_MAX_VALUE]) for k, v in _flatten(dict(config))
      ]
      for i in range(0, len(params), _MAX_PARAMS):
        self.client.log_batch(self.run_id, params=params[i : i + _MAX_PARAMS])
    if on_run_id is not None:
      on_run_id(self.run_id)

  def write(self, step: int, values: Mapping[str, float]) -> None:
    now = int(time.time() * 1000)
    metrics = [
      self._metric(mlflow_name(k), float(v), now, step)
      for k, v in values.items()
    ]
    for i in range(0, len(metrics), _MAX_METRICS):
      self.client.log_batch(self.run_id, metrics=metrics[i : i + _MAX_METRICS])

  def restart(self, step: int) -> None:
    pass  # MLflow keeps every point; the resumed run appends (module doc)

  def close(self) -> None:
    self.client.set_terminated(self.run_id)
