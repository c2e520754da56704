"""What a run's checkpoint holds, and resuming from it.

A checkpoint of step s (jaxcorr/train/checkpoints/checkpointer.py does the storage) is

    tree  {'state': TrainState, 'ref': the frozen reference params or None}
    meta  {'step': s, 'sft_done', 'loader': the prompt loader's state after
           the batch of step s − 1, 'config': the config string,
           'process_count'}

In sync mode a resumed run is bit-identical to an uninterrupted one: every
random choice derives from (train.seed, step) or from this state.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from jaxcorr.train.checkpoints.checkpointer import Checkpointer
from jaxcorr.train.checkpoints.tree import abstract_like
from jaxcorr.train.run_config import RunConfig
from jaxcorr.train.state import TrainState


@dataclasses.dataclass
class Progress:
  """Where a run stands, apart from its arrays."""

  step: int = 0
  sft_done: bool = False
  loader_state: dict | None = None


class RunCheckpoints:
  """Saves and restores a run's (state, reference params, `Progress`).

  Args:
    workdir: the run directory (checkpoints go to `<workdir>/checkpoints`).
    run: the validated run config (`train.checkpoint_every`,
      `train.keep_checkpoints`).
    config_name: the config string, recorded in every checkpoint.
    process_count: recorded too (a restore may use another count).
  """

  def __init__(
    self, workdir: str, run: RunConfig, config_name: str, process_count: int
  ):
    self.run = run
    self.config_name = config_name
    self.process_count = process_count
    self.checkpointer = Checkpointer(
      os.path.join(workdir, 'checkpoints'),
      every=run.train.checkpoint_every,
      keep=run.train.keep_checkpoints,
    )

  def save(
    self,
    progress: Progress,
    state: TrainState,
    ref_params: Any,
    *,
    force: bool = False,
  ) -> bool:
    meta = {
      'step': progress.step,
      'sft_done': progress.sft_done,
      'loader': progress.loader_state,
      'config': self.config_name,
      'process_count': self.process_count,
    }
    tree = {'state': state, 'ref': ref_params}
    return self.checkpointer.save(progress.step, tree, meta, force=force)

  def restore(
    self, state: TrainState, step: int | None = None
  ) -> tuple[TrainState, Any, Progress] | None:
    """(state, reference params, progress) of checkpoint `step` (None: the
    latest) in the shardings of `state`; None if there is no checkpoint."""
    if self.checkpointer.latest_step() is None:
      return None
    ref_like = state.params if self.run.needs_ref else None
    tree = {'state': state, 'ref': ref_like}
    abstract = abstract_like(tree)
    tree, meta = self.checkpointer.restore(abstract, step=step)
    progress = Progress(
      step=int(meta['step']),
      sft_done=bool(meta['sft_done']),
      loader_state=meta['loader'],
    )
    return tree['state'], tree['ref'], progress
