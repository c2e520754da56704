"""Restoring checkpoints: the restore half of `Checkpointer`
(jaxcorr/train/checkpoints/checkpointer.py), with the fallback to an older step when the
newest cannot be read, and partial restores (`restore_subtree`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from jaxcorr.train.checkpoints import failed_restore
from jaxcorr.train.checkpoints.tree import check_target, from_pure, to_pure


class CheckpointError(ValueError):
  """A checkpoint step that cannot be read, in one line."""


def _one_line(e: BaseException, limit: int = 400) -> str:
  """An error message on one line, at most `limit` characters (TensorStore
  errors append its whole JSON spec)."""
  text = ' '.join(line.strip() for line in str(e).splitlines() if line.strip())
  text = text or repr(e)
  return text if len(text) <= limit else text[: limit - 3] + '...'


class CheckpointRestore:
  """`Checkpointer`'s restore methods; mixed into `Checkpointer`, whose
  constructor sets `directory` and `_manager` and which provides
  `all_steps`."""

  def restore(
    self, abstract_state: Any, step: int | None = None
  ) -> tuple[Any, dict[str, Any]]:
    """`(state, meta)` of step `step` (None: the newest intact step).

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
    newest step's, in one line (`CheckpointError`, a ValueError), and
    nothing is renamed.
    """
    steps = self.all_steps()
    if step is not None:
      if step not in steps:
        raise FileNotFoundError(
          f'no checkpoint of step {step} in {self.directory}; have {steps}'
        )
      return self._restore_step(abstract_state, step)
    if not steps:
      raise FileNotFoundError(f'no checkpoint in {self.directory}')
    check_target(abstract_state)
    failed: list[tuple[int, CheckpointError]] = []
    for s in reversed(steps):
      try:
        out = self._restore_step(abstract_state, s)
      except CheckpointError as e:
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
    raise CheckpointError(
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
      raise CheckpointError(
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
    self, path: tuple[str, ...], abstract: Any, step: int | None = None
  ) -> tuple[Any, dict[str, Any], int]:
    """`(value, meta, step)`: the sub-tree at `path` of the saved state
    (e.g. `('state', 'params')`, the policy of the trainer's `{'state':
    TrainState, 'ref': ...}`) without the rest, for readers that have no
    full restore target (`jaxcorr.export`). `step=None`: the latest. The
    same one-line `CheckpointError` as `restore`."""
    steps = self.all_steps()
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
      raise CheckpointError(
        f'restoring {"/".join(path)} of checkpoint step {step} of '
        f'{self.directory} '
        f'failed: {type(e).__name__}: {_one_line(e)}'
      ) from None
    value = restored['state']
    for key in path:
      value = value[key]
    value = from_pure(abstract, value)
    return value, dict(restored['meta']), step
