"""The `wandb` logger: one Weights & Biases run per workdir.

The run's files go under `<workdir>/wandb/`. W&B's own environment
variables apply: `WANDB_MODE=offline` logs without network (the files are
synced later with `wandb sync <workdir>/wandb/offline-run-*`),
`WANDB_API_KEY` logs in. The run config is the run's W&B config, given
once when the run starts; a resumed workdir logs to the same run id
(kept in `<workdir>/logger_runs.json`). W&B keeps a run's steps
increasing, so a step the interrupted run had already logged is not
logged again (in sync mode the values would be the same: resume is exact).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


class WandbSink:
  """A `jaxcorr.train.tracker.sinks.Sink` writing to a W&B run."""

  name = 'wandb'

  def __init__(
    self,
    workdir: str,
    *,
    config: Mapping[str, Any],
    project: str,
    name: str,
    entity: str = '',
    run_id: str | None = None,
    on_run_id: Callable[[str], None] | None = None,
  ):
    import wandb

    self.run = wandb.init(
      dir=workdir,
      project=project,
      entity=entity or None,
      name=name,
      id=run_id,
      resume='allow' if run_id else None,
      config=dict(config),
      # The trainer prints its own progress line; W&B's console capture
      # and system sampling would only add threads to a training process.
      settings=wandb.Settings(console='off', x_disable_stats=True, silent=True),
    )
    self._last = -1
    if on_run_id is not None:
      on_run_id(self.run.id)

  def write(self, step: int, values: Mapping[str, float]) -> None:
    if step <= self._last:
      return
    self.run.log(dict(values), step=step)
    self._last = step

  def restart(self, step: int) -> None:
    # A resumed W&B run continues after its last logged step (module doc).
    self._last = max(self._last, step, getattr(self.run, 'step', 0) - 1)

  def close(self) -> None:
    self.run.finish()
