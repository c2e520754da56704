"""What a run's checkpoint holds, and resuming from it.

A checkpoint of step s (jaxcorr/train/checkpoints/checkpointer.py does the storage) is

    tree  {'state': TrainState, 'ref': the frozen reference params or None}
    meta  {'step': s, 'sft_done', 'loader': the prompt loader's state after
           the batch of step s − 1, 'config': the config string,
           'process_count', 'run_config': the run's whole config (the
           JSON of config.json)}

In sync mode a resumed run is bit-identical to an uninterrupted one: every
random choice derives from (train.seed, step) or from this state.

The restore compares 'run_config' with the config of the run resuming, as
the workdir claim compares config.json
(`jaxcorr.train.checkpoints.workdir.check_config`): without config.json a
changed learning rate is still refused unless --allow_config_change.

A save that fails for lack of disk space raises `DiskFull`, one line
naming the directory and its free space, in place of the storage layer's
traceback (and its threads' copies of it in the log).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
from typing import Any

import jax

from jaxcorr import console
from jaxcorr.train.checkpoints import checkpointer as checkpoint
from jaxcorr.train.checkpoints import workdir as workdir_lib
from jaxcorr.train.run_config import RunConfig
from jaxcorr.train.state import TrainState

# How the storage layer words ENOSPC: TensorStore raises a ValueError
# ("... No space left on device [os_error_code='28']"), Python an OSError.
_NO_SPACE = os.strerror(errno.ENOSPC)


class DiskFull(OSError):
  """A checkpoint that could not be written for lack of space (one line)."""


def no_space(e: BaseException | None) -> bool:
  """Whether `e` or an exception it was raised from is ENOSPC."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
      return True
    if _NO_SPACE in str(e):
      return True
    e = e.__cause__ or e.__context__
  return False


def free_space(path: str) -> str:
  """'1.2 GiB free' on the file system of `path` (or its nearest existing
  parent); 'free space unknown' for object stores."""
  if '://' in path:
    return 'free space unknown'
  path = os.path.abspath(path)
  while not os.path.exists(path):
    path = os.path.dirname(path)
  free = float(shutil.disk_usage(path).free)
  for unit in ('B', 'KiB', 'MiB', 'GiB'):
    if free < 1024 or unit == 'GiB':
      break
    free /= 1024
  return f'{free:.3g} {unit} free'


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
    config: the run's ConfigDict, recorded in every checkpoint (its JSON,
      with the process count: a restore may use another count) and
      compared with the restored one's (module doc).
    allow_change: resume a checkpoint of another config.
  """

  def __init__(
    self,
    workdir: str,
    run: RunConfig,
    config_name: str,
    *,
    config: Any = None,
    allow_change: bool = False,
  ):
    self.workdir = workdir
    self.run = run
    self.config_name = config_name
    self.process_count = jax.process_count()
    self.config = None if config is None else json.loads(config.to_json())
    self.allow_change = allow_change
    self.checkpointer = checkpoint.Checkpointer(
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
      'run_config': self.config,
    }
    tree = {'state': state, 'ref': ref_params}
    try:
      with console.dropped_library_errors(_NO_SPACE):
        return self.checkpointer.save(progress.step, tree, meta, force=force)
    except Exception as e:
      if not no_space(e):
        raise
      latest = self.checkpointer.latest_step()
      raise DiskFull(
        f'checkpoint step {progress.step} not written: no space left on '
        f'the device of {self.workdir} ({free_space(self.workdir)}); free '
        'some space or move the workdir, then re-run to resume from '
        + ('the start' if latest is None else f'step {latest}'),
      ) from None

  def restore(
    self, state: TrainState, step: int | None = None
  ) -> tuple[TrainState, Any, Progress] | None:
    """(state, reference params, progress) of checkpoint `step` (None: the
    latest) in the shardings of `state`; None if there is no checkpoint."""
    if self.checkpointer.latest_step() is None:
      return None
    ref_like = state.params if self.run.needs_ref else None
    tree = {'state': state, 'ref': ref_like}
    abstract = checkpoint.abstract_like(tree)
    tree, meta = self.checkpointer.restore(abstract, step=step)
    saved = meta.get('run_config')
    if saved is not None and self.config is not None:
      workdir_lib.check_config(
        self.workdir,
        saved,
        self.config,
        allow_change=self.allow_change,
        source=f'checkpoint step {meta["step"]}',
      )
    progress = Progress(
      step=int(meta['step']),
      sft_done=bool(meta['sft_done']),
      loader_state=meta['loader'],
    )
    return tree['state'], tree['ref'], progress
