"""Adapter-only checkpoints: the adapters and their optimizer state round
trip exactly, the base is not saved but fingerprinted, and a restore onto
another base, or with another adapter layout (even with
--allow_config_change), is refused with a one-line error naming the
difference."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from jaxcorr.rollout.adapter_weights import AdapterUpdate
from jaxcorr.train import build, setup
from jaxcorr.train.checkpoints.base_fingerprint import (
  AdapterLayoutError,
  BaseMismatchError,
)
from jaxcorr.train.checkpoints.resume import Progress, RunCheckpoints
from jaxcorr.train.checkpoints.workdir import ConfigChanged
from jaxcorr.train.policy import build_policy
from jaxcorr.train.rollouts.weights import weight_sync
from tests.helpers.step_batches import one_device_mesh
from tests.helpers.trainer_config import pulse_config


def _config(seed: int = 0, hidden: int = 256, **lora):
  return pulse_config(
    train__sft_steps=0,
    lora__rank=lora.pop('rank', 2),
    model__init_seed=seed,
    model__hidden_size=hidden,
    model__intermediate_size=3 * hidden,
    rollout__mode='async',
    rollout__max_staleness=1,
    **{f'lora__{k}': v for k, v in lora.items()},
  )


def _learner(seed: int, config=None):
  run = build.build(config or _config(seed))
  mesh = one_device_mesh()
  policy = build_policy(run.model, mesh, run.lora)
  state = setup.build_learner(run, policy, mesh)[0]
  return run, state, weight_sync(run, policy)


def _bytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_adapter_checkpoint_round_trip_and_base_check(tmp_path):
  run, state, sync = _learner(0)
  # Non-trivial values: B and the moments must come back bit for bit.
  state = state.replace(
    params=jax.tree.map(lambda x: x + 0.5, state.params),
    opt_state=jax.tree.map(lambda x: x + 1, state.opt_state),
  )
  ckpt = RunCheckpoints(str(tmp_path), run, 'pulse')
  # Fixed lag: the producer's adapters of version 2 are saved beside.
  lagged = {2: sync(state)}
  progress = Progress(step=3, sft_done=True, lagged=lagged)
  assert ckpt.save(progress, state, None, force=True)
  ckpt.checkpointer.wait()
  saved = sum(
    os.path.getsize(os.path.join(d, f))
    for d, _, files in os.walk(tmp_path)
    for f in files
  )
  # Adapters + Adam moments, far below the base's bytes.
  assert saved < _bytes(state.frozen) / 2
  _, fresh, _ = _learner(0)
  restored, _, progress = ckpt.restore(fresh)
  assert progress.step == 3
  assert isinstance(progress.lagged[2], AdapterUpdate)
  for a, b in zip(jax.tree.leaves(lagged), jax.tree.leaves(progress.lagged)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(
    jax.tree.leaves((state.params, state.opt_state)),
    jax.tree.leaves((restored.params, restored.opt_state)),
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert restored.frozen is fresh.frozen
  _, other, _ = _learner(1)
  with pytest.raises(BaseMismatchError, match=r'other base weights.*differs'):
    ckpt.restore(other)
  ckpt.close()


@pytest.mark.parametrize(
  'change, field',
  [
    ({'rank': 4}, r'config\.lora\.rank=4: .* rank 2'),
    ({'rank': 0}, r'config\.lora\.rank=0: .* adapters of rank 2'),
    ({'target_modules': 'q_proj,v_proj'}, r'config\.lora\.target_modules'),
  ],
)
def test_another_adapter_layout_is_refused_naming_the_field(
  tmp_path, change, field
):
  """--allow_config_change lets the config through, but adapters of
  another layout cannot be restored: one line naming the field, before
  any array is read (was: Orbax's shape / tree-structure error)."""
  small = _config(hidden=64)
  run, state, _ = _learner(0, small)
  ckpt = RunCheckpoints(str(tmp_path), run, 'pulse', config=small)
  assert ckpt.save(Progress(step=1), state, None, force=True)
  ckpt.close()
  changed = _config(hidden=64, **change)
  run2, fresh, _ = _learner(0, changed)
  resumed = RunCheckpoints(
    str(tmp_path), run2, 'pulse', config=changed, allow_change=True
  )
  with pytest.raises(AdapterLayoutError, match=field) as e:
    resumed.restore(fresh)
  assert '\n' not in str(e.value)
  resumed.close()


def test_restore_errors_are_config_changes():
  """`jaxcorr.main` prints a `ConfigChanged` in one line: a changed base
  too (was a traceback)."""
  assert issubclass(BaseMismatchError, ConfigChanged)
  assert issubclass(AdapterLayoutError, ConfigChanged)
