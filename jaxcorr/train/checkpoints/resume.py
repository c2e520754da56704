"""What a run's checkpoint holds, and resuming from it.

A checkpoint of step s (jaxcorr/train/checkpoints/checkpointer.py does the storage) is

    tree  {'state': TrainState, 'ref': the frozen reference params or None}
    meta  {'step': s, 'sft_done', 'loader': the prompt loader's state after
           the batch of step s − 1, 'config': the config string,
           'process_count', 'run_config': the run's whole config (the
           JSON of config.json), 'lagged': the versions below}

and, in fixed-lag async mode, the engine's weights of the older versions
the next batches are sampled by (`AsyncRollouts.lagged`: versions
max(s − k, 0) .. s − 1 for `rollout.max_staleness` k) as step s of a
second store, `<workdir>/lagged_weights/`, written before the main one:
the main tree keeps one layout for every mode, so a run resumed in
another mode or lag (`--allow_config_change`) still restores it.

LoRA runs (`config.lora.rank > 0`) save the adapters, not the frozen base
(`TrainState.frozen` is left out of the tree), and record the base's
fingerprint in meta 'base_fingerprint'; a restore onto another base raises
`BaseMismatchError`, and one of another adapter layout (LoRA turned on or
off, another rank or `target_modules`, even with `--allow_config_change`)
`AdapterLayoutError` before any array is read, each a one-line
`ConfigChanged` error (jaxcorr/train/checkpoints/base_fingerprint.py).

A resumed run is bit-identical to an uninterrupted one in sync and
fixed-lag async mode: every random choice derives from (train.seed, step)
or from this state, and the lagged weights sample the batches in the
pipeline exactly as before. A fixed-lag checkpoint without them (another
mode's, or the lagged store gone) resumes with a warning: the first k
batches are sampled by the resumed weights.

The restore compares 'run_config' with the config of the run resuming, as
the workdir claim compares config.json
(`jaxcorr.train.checkpoints.workdir.check_config`): without config.json a
changed learning rate is still refused unless --allow_config_change.

A save that fails for lack of disk space raises `disk_full.DiskFull`, one
line naming the directory and its free space
(jaxcorr/train/checkpoints/disk_full.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from jaxcorr import console
from jaxcorr.model.lora import PROBE_LENGTH
from jaxcorr.rollout.adapter_weights import AdapterUpdate
from jaxcorr.train.checkpoints import checkpointer as checkpoint
from jaxcorr.train.checkpoints import workdir as workdir_lib
from jaxcorr.train.checkpoints.base_fingerprint import (
  check_adapters,
  check_base,
  fingerprint,
)
from jaxcorr.train.checkpoints.disk_full import (
  NO_SPACE,
  DiskFull,
  free_space,
  no_space,
)
from jaxcorr.train.checkpoints.tree import abstract_like
from jaxcorr.train.rollouts.weights import engine_params
from jaxcorr.train.run_config import RunConfig
from jaxcorr.train.state import TrainState

LAGGED_DIR = 'lagged_weights'


@dataclasses.dataclass
class Progress:
  """Where a run stands, apart from its arrays."""

  step: int = 0
  sft_done: bool = False
  loader_state: dict | None = None
  # Fixed-lag async: {version: engine weights} older than `step` that the
  # next batches are sampled by (module doc).
  lagged: dict[int, Any] = dataclasses.field(default_factory=dict)


def _engine_copy(run: RunConfig, state: TrainState) -> Any:
  """What the producer holds per lagged version: `engine_params`, or for
  LoRA an `AdapterUpdate` (adapters + the probe's log-probs)."""
  if state.frozen is None:
    return engine_params(run, state.params)
  leaf = jax.tree.leaves(state.params)[0]
  rep = jax.sharding.NamedSharding(
    leaf.sharding.mesh, jax.sharding.PartitionSpec()
  )
  probe = jax.ShapeDtypeStruct((PROBE_LENGTH - 1,), jnp.float32, sharding=rep)
  return AdapterUpdate(state.params, probe)


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
    t = run.train
    self.checkpointer = checkpoint.Checkpointer(
      os.path.join(workdir, 'checkpoints'),
      every=t.checkpoint_every,
      keep=t.keep_checkpoints,
    )
    self._base_fingerprint = None  # LoRA (module doc)
    self.lagged_store = None  # module doc
    if run.rollout.mode == 'async' and run.rollout.max_staleness:
      self.lagged_store = checkpoint.Checkpointer(
        os.path.join(workdir, LAGGED_DIR),
        every=t.checkpoint_every,
        keep=t.keep_checkpoints,
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
      'lagged': sorted(progress.lagged),
    }
    # LoRA: adapters only, base fingerprinted (a bare pytree has no base).
    if getattr(state, 'frozen', None) is not None:
      meta['base_fingerprint'] = self._fingerprint(state.frozen)
      state = state.replace(frozen=None)
    tree = {'state': state, 'ref': ref_params}
    due = force or self.checkpointer.should_save(progress.step)
    try:
      with console.dropped_library_errors(NO_SPACE):
        if due and progress.lagged and self.lagged_store is not None:
          lagged = {f'v{v}': w for v, w in progress.lagged.items()}
          self.lagged_store.save(progress.step, lagged, {}, force=True)
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
    self._check_adapters(step)
    ref_like = state.params if self.run.needs_ref else None
    frozen = state.frozen
    tree = {'state': state.replace(frozen=None), 'ref': ref_like}
    abstract = abstract_like(tree)
    tree, meta = self.checkpointer.restore(abstract, step=step)
    source = f'checkpoint step {meta["step"]} of {self.workdir}'
    check_adapters(meta, self.run.lora, source, self.workdir)
    if frozen is not None:
      check_base(meta['base_fingerprint'], self._fingerprint(frozen), source)
      tree['state'] = tree['state'].replace(frozen=frozen)
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
    progress.lagged = self._restore_lagged(
      progress.step, meta.get('lagged') or [], tree['state']
    )
    return tree['state'], tree['ref'], progress

  def _check_adapters(self, step: int | None) -> None:
    """`check_adapters` on the meta of the step a restore reads first,
    before its arrays: Orbax's error for a tree of another layout names
    array shapes, not the field. A step whose meta cannot be read is left
    to the restore (it falls back to an older step, checked after)."""
    step = self.checkpointer.latest_step() if step is None else step
    try:
      meta = self.checkpointer.meta(step)
    except Exception:  # a damaged step: the restore reports it
      return
    check_adapters(
      meta,
      self.run.lora,
      f'checkpoint step {step} of {self.workdir}',
      self.workdir,
    )

  def _restore_lagged(
    self, step: int, versions: list[int], state: TrainState
  ) -> dict[int, Any]:
    """The lagged weights of checkpoint `step` for this run's producer:
    `{}` outside fixed-lag async mode, or with a warning when the
    checkpoint has none for this lag."""
    if self.lagged_store is None:
      return {}
    lag = self.run.rollout.max_staleness
    want = list(range(max(step - lag, 0), step))
    if versions and versions == want[-len(versions) :]:
      # Shapes, dtypes and shardings of the engine's copies (weights.py).
      like = abstract_like(_engine_copy(self.run, state))
      target = {f'v{v}': like for v in versions}
      try:
        values, _ = self.lagged_store.restore(target, step=step)
        return {v: values[f'v{v}'] for v in versions}
      except (OSError, ValueError) as e:  # absent, or a CheckpointError
        logging.warning('%s', e)
    if want:
      logging.warning(
        'checkpoint step %d holds no lagged weights for '
        'rollout.max_staleness=%d: batches %d..%d are sampled by the '
        'resumed weights (the resume is not exact)',
        step,
        lag,
        step,
        step + lag - 1,
      )
    return {}

  def _fingerprint(self, frozen: Any) -> dict:
    """The base's fingerprint, computed once per base (it never changes)."""
    held = self._base_fingerprint
    if held is None or held[0] is not frozen:
      self._base_fingerprint = held = (frozen, fingerprint(frozen))
    return held[1]

  def close(self) -> None:
    """Wait for pending saves and release the stores (idempotent)."""
    self.checkpointer.close()
    if self.lagged_store is not None:
      self.lagged_store.close()
