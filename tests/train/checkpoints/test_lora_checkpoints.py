"""Adapter-only checkpoints: the adapters and their optimizer state round
trip exactly, the base is not saved but fingerprinted, and a restore onto
another base is refused with an error naming the difference."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from jaxcorr.rollout.adapter_weights import AdapterUpdate
from jaxcorr.train import build, setup
from jaxcorr.train.checkpoints.base_fingerprint import BaseMismatchError
from jaxcorr.train.checkpoints.resume import Progress, RunCheckpoints
from jaxcorr.train.policy import build_policy
from jaxcorr.train.rollouts.weights import weight_sync
from tests.helpers.step_batches import one_device_mesh
from tests.helpers.trainer_config import pulse_config


def _learner(seed: int):
  run = build.build(
    pulse_config(
      train__sft_steps=0,
      lora__rank=2,
      model__init_seed=seed,
      model__hidden_size=256,
      model__intermediate_size=768,
      rollout__mode='async',
      rollout__max_staleness=1,
    )
  )
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
