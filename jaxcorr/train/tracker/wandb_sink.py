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

import os
from collections.abc import Callable, Mapping
from typing import Any

INIT_TIMEOUT_S = 10.0
"""How long an online run may take to start (W&B's own default: 90 s,
that long a stall of the trainer when the server is unreachable); the
user's `WANDB_INIT_TIMEOUT` wins. A run that does not start in time is a
warning naming the server, and training goes on without it."""


def init_timeout() -> float:
  """`WANDB_INIT_TIMEOUT` if set, else `INIT_TIMEOUT_S`."""
  return float(os.environ.get('WANDB_INIT_TIMEOUT') or INIT_TIMEOUT_S)


def server() -> str:
  """The W&B server a run talks to (`WANDB_BASE_URL`, else W&B's own)."""
  return os.environ.get('WANDB_BASE_URL') or 'https://api.wandb.ai'


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

    try:
      self.run = self._init(
        wandb, workdir, config, project, name, entity, run_id
      )
    except Exception as e:  # W&B's own errors span a page
      first = (str(e).strip().splitlines() or [''])[0][:200]
      raise RuntimeError(
        f'W&B run did not start (server {server()}, '
        f'init timeout {init_timeout():g} s): {type(e).__name__}: {first}'
      ) from None
    self._last = -1
    if on_run_id is not None:
      on_run_id(self.run.id)

  @staticmethod
  def _init(wandb, workdir, config, project, name, entity, run_id):
    return wandb.init(
      dir=workdir,
      project=project,
      entity=entity or None,
      name=name,
      id=run_id,
      resume='allow' if run_id else None,
      config=dict(config),
      # The trainer prints its own progress line; W&B's console capture
      # and system sampling would only add threads to a training process.
      settings=wandb.Settings(
        console='off',
        x_disable_stats=True,
        silent=True,
        init_timeout=init_timeout(),
      ),
    )

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
