"""Checkpoints: the device state and a JSON record, per step, via Orbax.

A checkpoint of step `s` is one directory `<directory>/<s>/` with two items:

* `state`: a pytree of arrays (the `TrainState`: params as `nnx.State`, the
  optax state, PRNG key (raw uint32 or typed), KL-controller state, ...;
  NumPy arrays, Python scalars and `None` too), written by
  `orbax.checkpoint.StandardSave`: every process writes the shards it owns
  (OCDBT + tensorstore), so sharded arrays on a multi-host mesh need no
  gathering, and a restore reshards onto whatever shardings the caller's
  abstract target names (another mesh shape, another device count).
* `meta`: a JSON object (data loader position, config string, step metrics,
  ...), written by `orbax.checkpoint.JsonSave` from the primary process.
  NumPy / JAX scalars in it are stored as Python numbers; NaN is kept (as
  the `NaN` token Python's json module reads back).

`nnx.Variable`s are stored as their bare values: the on-disk tree is the
`nnx.to_pure_dict` form (`params/layers/0/attn/q_proj/kernel`, no `value`
suffix), so a checkpoint does not depend on how a Flax version flattens a
Variable, and can be read into a plain dict as well as into an `nnx.State`.
`restore` puts the values back into the Variables of the abstract target,
whose metadata (logical axes, ...) is kept.

Atomicity comes from Orbax: a save writes `<s>.orbax-checkpoint-tmp*` and
renames it to `<s>` on commit (on object stores, which cannot rename, it
writes a `commit_success.txt` last and readers ignore a step without it). A
crash mid-save leaves only a temporary directory, which `latest_step` never
reports and the next `Checkpointer` on the directory deletes. `latest_step`
waits for a pending asynchronous save and then re-lists the directory, so it
never reports a step that is still being written.

Retention: `save` writes when `should_save(step)` (`step % every == 0`) or
when forced, then Orbax deletes all but the newest `keep` steps. A step that
exists already is never overwritten (`save` returns False).

This module holds `Checkpointer` (queries, saving, closing); it restores
through a `Restorer` (jaxcorr/train/checkpoints/restore.py: the fallback to
an older step, partial restores) and writes the on-disk tree form of
jaxcorr/train/checkpoints/tree.py.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from jaxcorr.train.checkpoints.restore import Restorer
from jaxcorr.train.checkpoints.tree import jsonable, to_pure


def _local_path(directory: str) -> str:
  """Absolute path for local directories; URLs (gs://...) as given."""
  if '://' in directory:
    return directory
  return os.path.abspath(os.path.expanduser(directory))


class Checkpointer:
  """Saves and restores `(state, meta)` per step (module doc).

  Every process of a multi-host job must make the same calls in the same
  order (saves and restores are collective); `meta` is written by the
  primary process only, and read by every process.

  Args:
    directory: the checkpoint root (one sub-directory per step); a local
      path or a URL tensorstore understands (`gs://...`).
    every: `should_save(step)` is true when `step % every == 0`; `every <=
      0` means only forced saves.
    keep: how many of the newest steps to keep (>= 1).
    async_save: write in a background thread. `save` returns once the
      arrays are copied to host memory, so the caller may update or donate
      them right away; `wait()` blocks until the write is committed.
    read_only: only read (`jaxcorr.export` next to a live run): the
      directory is neither created nor cleaned of temporary directories,
      which may be another process's saves in flight.
  """

  def __init__(
    self,
    directory: str,
    *,
    every: int,
    keep: int,
    async_save: bool = False,
    read_only: bool = False,
  ):
    if isinstance(every, bool) or not isinstance(every, int):
      raise ValueError(f'every must be an int, got {every!r}')
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
      raise ValueError(f'keep must be an int >= 1, got {keep!r}')
    self.directory = _local_path(directory)
    self.every = every
    self.keep = keep
    self.async_save = bool(async_save)
    options = ocp.CheckpointManagerOptions(
      max_to_keep=None if read_only else keep,
      # `should_save` decides; saves are forced.
      save_interval_steps=0 if read_only else 1,
      create=not read_only,
      cleanup_tmp_directories=not read_only,
      read_only=read_only,
      enable_async_checkpointing=self.async_save,
    )
    self._manager = ocp.CheckpointManager(
      self.directory, options=options, item_names=('state', 'meta')
    )
    self._restorer = Restorer(self.directory, self._manager)
    self._closed = False

  # ------------------------------------------------------------ queries

  def should_save(self, step: int) -> bool:
    """Whether `step` is a regular checkpoint step (`step % every == 0`)."""
    return self.every > 0 and step % self.every == 0

  def all_steps(self) -> list[int]:
    """The committed steps on disk, oldest first.

    Waits for pending asynchronous saves, then lists the directory afresh
    (another process may have written it): temporary directories of crashed
    saves are never reported.
    """
    self._check_open()
    self.wait()
    self._manager.reload()
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest committed step (`all_steps`), or None when there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  # --------------------------------------------------------------- save

  def save(
    self,
    step: int,
    state: Any,
    meta: Mapping[str, Any],
    *,
    force: bool = False,
  ) -> bool:
    """Checkpoint `state` and `meta` as step `step`; True if written.

    Writes when `force` or `should_save(step)`, unless step `step` exists
    already (a checkpoint is never overwritten). With `async_save` the write
    finishes in the background (`wait`).
    """
    self._check_open()
    if isinstance(step, bool) or not isinstance(step, int | np.integer):
      raise ValueError(f'step must be an int, got {step!r}')
    step = int(step)
    if step < 0:
      raise ValueError(f'step must be >= 0, got {step}')
    if not isinstance(meta, Mapping):
      raise ValueError(
        f'meta must be a dict of JSON values, got {type(meta).__name__}'
      )
    if not (force or self.should_save(step)):
      return False
    if step in self._manager.all_steps():
      logging.warning('checkpoint step %d exists already; not saved', step)
      return False
    meta = jsonable(meta, 'meta')
    saved = self._manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(to_pure(state)),
        meta=ocp.args.JsonSave(meta),
      ),
      force=True,
    )
    if saved:
      logging.info('checkpoint step %d -> %s', step, self.directory)
    return bool(saved)

  def wait(self) -> None:
    """Block until every started save is committed."""
    self._manager.wait_until_finished()

  # ------------------------------------------------------------ restore

  def restore(
    self, abstract_state: Any, step: int | None = None
  ) -> tuple[Any, dict[str, Any]]:
    """`(state, meta)` of step `step` (None: the newest intact step, older
    ones tried when the newest cannot be read): `Restorer.restore`.

    `abstract_state` (`tree.abstract_like(state)`) gives the tree
    structure, dtypes and target shardings. Raises FileNotFoundError when
    the step is absent and `CheckpointRestoreError` (one line) when no
    step can be read.
    """
    return self._restorer.restore(abstract_state, self.all_steps(), step)

  def restore_subtree(
    self, path: tuple[str, ...], abstract: Any, step: int | None = None
  ) -> tuple[Any, dict[str, Any], int]:
    """`(value, meta, step)`: the sub-tree at `path` of the saved state
    (`Restorer.restore_subtree`); `step=None`: the latest."""
    return self._restorer.restore_subtree(
      path, abstract, self.all_steps(), step
    )

  def meta(self, step: int) -> dict[str, Any]:
    """The JSON meta of committed step `step` alone (no state read)."""
    self._check_open()
    restored = self._manager.restore(
      step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
    )
    return dict(restored['meta'])

  # ------------------------------------------------------------ closing

  def close(self) -> None:
    """Wait for pending saves and release Orbax's resources (idempotent)."""
    if not self._closed:
      self._manager.wait_until_finished()
      self._manager.close()
      self._closed = True

  def _check_open(self) -> None:
    if self._closed:
      raise ValueError(f'Checkpointer of {self.directory} is closed')

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __repr__(self) -> str:
    return (
      f'Checkpointer({self.directory!r}, every={self.every}, '
      f'keep={self.keep}, async_save={self.async_save})'
    )
