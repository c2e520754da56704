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
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax import nnx

from jaxcorr.train import failed_restore


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def abstract_like(state: Any) -> Any:
  """The restore target of `state`: a `jax.ShapeDtypeStruct` with shape,
  dtype and sharding for every `jax.Array` leaf.

  NumPy arrays and Python scalars are kept as they are (Orbax restores them
  as NumPy arrays and Python scalars); `nnx.Variable` wrappers and their
  metadata are kept around the abstract values.
  """

  def one(x):
    if isinstance(x, jax.Array):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x

  return jax.tree.map(one, state)


def _to_pure(tree: Any) -> Any:
  """Every `nnx.Variable` replaced by its value (the on-disk form)."""
  return jax.tree.map(
    lambda x: x.get_value() if _is_variable(x) else x,
    tree,
    is_leaf=_is_variable,
  )


def _from_pure(target: Any, values: Any) -> Any:
  """`values` (the pure form of `target`) put back into its Variables."""
  return jax.tree.map(
    lambda t, v: t.replace(v) if _is_variable(t) else v,
    target,
    values,
    is_leaf=_is_variable,
  )


def _check_target(abstract_state: Any) -> None:
  """Every abstract array names its sharding (else Orbax guesses one)."""
  flat = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
  for path, leaf in flat:
    if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None:
      raise ValueError(
        f'restore target leaf {jax.tree_util.keystr(path)} is a '
        'ShapeDtypeStruct without a sharding; build the target with '
        'checkpoint.abstract_like(state) or pass sharding=...'
      )


def _jsonable(value: Any, where: str) -> Any:
  """`value` with NumPy / JAX scalars and arrays as Python numbers and lists.

  Raises a ValueError naming the offending key path for anything JSON cannot
  hold.
  """
  if value is None or isinstance(value, str | bool | int | float):
    return value
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, jax.Array | np.ndarray):
    return np.asarray(jax.device_get(value)).tolist()
  if isinstance(value, Mapping):
    out = {}
    for k, v in value.items():
      if not isinstance(k, str):
        raise ValueError(
          f'checkpoint meta key {where}[{k!r}] must be a str, got '
          f'{type(k).__name__}'
        )
      out[k] = _jsonable(v, f'{where}[{k!r}]')
    return out
  if isinstance(value, list | tuple):
    return [_jsonable(v, f'{where}[{i}]') for i, v in enumerate(value)]
  raise ValueError(
    f'checkpoint meta value {where} of type {type(value).__name__} is not '
    'JSON-serialisable (allowed: dict, list, str, int, float, bool, None, '
    'NumPy/JAX scalars and arrays)'
  )


class CheckpointError(ValueError):
  """A checkpoint step that cannot be read, in one line."""


def _one_line(e: BaseException, limit: int = 400) -> str:
  """An error message on one line, at most `limit` characters (TensorStore
  errors append its whole JSON spec)."""
  text = ' '.join(line.strip() for line in str(e).splitlines() if line.strip())
  text = text or repr(e)
  return text if len(text) <= limit else text[: limit - 3] + '...'


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
    meta = _jsonable(meta, 'meta')
    saved = self._manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(_to_pure(state)),
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
    _check_target(abstract_state)
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
    _check_target(abstract_state)
    failed_restore.install()
    try:
      restored = self._manager.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(_to_pure(abstract_state)),
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
    state = _from_pure(abstract_state, restored['state'])
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
    _check_target(abstract)
    item = _to_pure(abstract)
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
    value = _from_pure(abstract, value)
    return value, dict(restored['meta']), step

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
