"""Adapter-only checkpoints: the adapters and their optimizer state round
trip exactly, the base is not saved but fingerprinted, and a restore onto
another base is refused with an error naming the difference."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from jaxcorr.train import build, setup
from jaxcorr.train.checkpoints.base_fingerprint import BaseMismatchError
from jaxcorr.train.checkpoints.resume import Progress, RunCheckpoints
from jaxcorr.train.policy import build_policy
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
    )
  )
  mesh = one_device_mesh()
  return run, setup.build_learner(
    run, build_policy(run.model, mesh, run.lora), mesh
  )[0]


def _bytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_adapter_checkpoint_round_trip_and_base_check(tmp_path):
  run, state = _learner(0)
  # Non-trivial values: B and the moments must come back bit for bit.
  state = state.replace(
    params=jax.tree.map(lambda x: x + 0.5, state.params),
    opt_state=jax.tree.map(lambda x: x + 1, state.opt_state),
  )
  ckpt = RunCheckpoints(str(tmp_path), run, 'pulse')
  assert ckpt.save(Progress(step=3, sft_done=True), state, None, force=True)
  ckpt.checkpointer.wait()
  saved = sum(
    os.path.getsize(os.path.join(d, f))
    for d, _, files in os.walk(tmp_path / 'checkpoints')
    for f in files
  )
  # Adapters + Adam moments, far below the base's bytes.
  assert saved < _bytes(state.frozen) / 2
  _, fresh = _learner(0)
  restored, _, progress = ckpt.restore(fresh)
  assert progress.step == 3
  for a, b in zip(
    jax.tree.leaves((state.params, state.opt_state)),
    jax.tree.leaves((restored.params, restored.opt_state)),
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert restored.frozen is fresh.frozen
  _, other = _learner(1)
  with pytest.raises(BaseMismatchError, match=r'other base weights.*differs'):
    ckpt.restore(other)
  ckpt.close()
