"""Restoring checkpoints: `Restorer`, the helper `Checkpointer`
(jaxcorr/train/checkpoints/checkpointer.py) reads steps back with, including
the fallback to an older step when the newest cannot be read, and partial
restores (`restore_subtree`). A step that cannot be read raises
`CheckpointRestoreError`, in one line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from jaxcorr.train.checkpoints import failed_restore
from jaxcorr.train.checkpoints.tree import check_target, from_pure, to_pure


class CheckpointRestoreError(ValueError):
  """A training checkpoint step that cannot be restored, in one line (a
  damaged step, or a restore target of another layout).

  Not to be confused with `jaxcorr.model.hf_io.WeightsMismatchError`, a
  Hugging Face weights directory that does not match its config; both are
  ValueErrors, the one base they share.
  """


def _one_line(e: BaseException, limit: int = 400) -> str:
  """An error message on one line, at most `limit` characters (TensorStore
  errors append its whole JSON spec)."""
  text = ' '.join(line.strip() for line in str(e).splitlines() if line.strip())
  text = text or repr(e)
  return text if len(text) <= limit else text[: limit - 3] + '...'


class Restorer:
  """Reads steps of one checkpoint directory back (module docstring).

  Args:
    directory: the checkpoint root, for messages and renaming unreadable
      steps.
    manager: the Orbax `CheckpointManager` of `directory` (the
      `Checkpointer`'s, shared: saves and restores go through one manager).

  The caller passes the committed steps (`Checkpointer.all_steps`, which
  waits for pending saves first) to each call.
  """

  def __init__(self, directory: str, manager: ocp.CheckpointManager):
    self.directory = directory
    self._manager = manager

  def restore(
    self,
    abstract_state: Any,
    steps: Sequence[int],
    step: int | None = None,
  ) -> tuple[Any, dict[str, Any]]:
    """`(state, meta)` of step `step` (None: the newest intact step) among
    the committed `steps` (oldest first).

    `abstract_state` gives the tree structure, dtypes and target shardings
    (`abstract_like(state)`); arrays are read straight into those shardings,
    whatever mesh the checkpoint was written from. Variables of the target
    keep their metadata. The target must have the saved tree structure: an
    extra or missing key, or arrays where `None` was saved, raise a
    ValueError listing the differing keys (a `None` in the target where
    arrays were saved restores as `None`). Raises FileNotFoundError when the
    step is absent.

    With `step=None` a latest step that cannot be read (truncated or missing
    data, metadata or manifest files) is reported in one log line and the
    next older one is tried; the unreadable steps are then renamed
    `<step>.unreadable` (kept for inspection, no longer a step, so the
    resumed run can save that step again). When no step can be restored (a
    damaged directory, or a target of another layout), the error is the
    newest step's, in one line (`CheckpointRestoreError`, a ValueError),
    and nothing is renamed.
    """
    if step is not None:
      if step not in steps:
        raise FileNotFoundError(
          f'no checkpoint of step {step} in {self.directory}; have {steps}'
        )
      return self._restore_step(abstract_state, step)
    if not steps:
      raise FileNotFoundError(f'no checkpoint in {self.directory}')
    check_target(abstract_state)
    failed: list[tuple[int, CheckpointRestoreError]] = []
    for s in reversed(steps):
      try:
        out = self._restore_step(abstract_state, s)
      except CheckpointRestoreError as e:
        failed.append((s, e))
        logging.warning('%s; trying an older step', e)
        continue
      for bad, _ in failed:
        self._set_aside(bad)
      if failed:
        logging.warning(
          'restored step %d of %s (newer unreadable: %s)',
          s,
          self.directory,
          [b for b, _ in failed],
        )
      return out
    if len(failed) == 1:
      raise failed[0][1]
    raise CheckpointRestoreError(
      f'{failed[0][1]} (and every older step: {[b for b, _ in failed[1:]]})'
    )

  def _restore_step(
    self, abstract_state: Any, step: int
  ) -> tuple[Any, dict[str, Any]]:
    check_target(abstract_state)
    failed_restore.install()
    try:
      restored = self._manager.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(to_pure(abstract_state)),
          meta=ocp.args.JsonRestore(),
        ),
      )
      meta = restored['meta']
      if not isinstance(meta, Mapping):
        raise ValueError(f'meta is {type(meta).__name__}, not a JSON object')
    except Exception as e:  # orbax / tensorstore / json: one line (doc)
      failed_restore.discard_leftovers(e)
      raise CheckpointRestoreError(
        f'restoring checkpoint step {step} of {self.directory} failed: '
        f'{type(e).__name__}: {_one_line(e)}'
      ) from None
    state = from_pure(abstract_state, restored['state'])
    return state, dict(meta)

  def _set_aside(self, step: int) -> None:
    """Renames an unreadable step directory out of the step namespace."""
    if jax.process_index() != 0:
      return
    src = epath.Path(self.directory) / str(step)
    dst = epath.Path(self.directory) / f'{step}.unreadable'
    if dst.exists():
      dst.rmtree()
    src.rename(dst)
    self._manager.reload()

  def restore_subtree(
    self,
    path: tuple[str, ...],
    abstract: Any,
    steps: Sequence[int],
    step: int | None = None,
  ) -> tuple[Any, dict[str, Any], int]:
    """`(value, meta, step)`: the sub-tree at `path` of the saved state
    (e.g. `('state', 'params')`, the policy of the trainer's `{'state':
    TrainState, 'ref': ...}`) without the rest, for readers that have no
    full restore target (`jaxcorr.export`). `step=None`: the latest of
    `steps`. The same one-line `CheckpointRestoreError` as `restore`."""
    if not steps:
      raise FileNotFoundError(f'no checkpoint in {self.directory}')
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise FileNotFoundError(
        f'no checkpoint of step {step} in {self.directory}; have {steps}'
      )
    check_target(abstract)
    item = to_pure(abstract)
    for key in reversed(path):
      item = {key: item}
    failed_restore.install()
    try:
      restored = self._manager.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(
            item=item,
            restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=True,
          ),
          meta=ocp.args.JsonRestore(),
        ),
      )
    except Exception as e:  # orbax / tensorstore / json: one line
      failed_restore.discard_leftovers(e)
      raise CheckpointRestoreError(
        f'restoring {"/".join(path)} of checkpoint step {step} of '
        f'{self.directory} '
        f'failed: {type(e).__name__}: {_one_line(e)}'
      ) from None
    value = restored['state']
    for key in path:
      value = value[key]
    value = from_pure(abstract, value)
    return value, dict(restored['meta']), step
