"""Adapter-only training (config.lora.rank > 0): the update differentiates
and optimises the LoRA leaves only; the base weights pass through the
donated update untouched and uncopied."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxcorr.train import batch as batch_lib
from jaxcorr.train import build, setup
from jaxcorr.train.policy import build_policy
from tests.helpers.step_batches import one_device_mesh, step_arrays
from tests.helpers.trainer_config import pulse_config


def test_only_adapters_train_and_the_base_is_not_copied():
  run = build.build(
    pulse_config(
      'decoupled_token_is',
      train__sft_steps=0,
      train__mini_batches=2,
      train__shuffle_minibatches=False,
      lora__rank=4,
      lora__target_modules='q_proj,v_proj,down_proj',
    )
  )
  mesh = one_device_mesh()
  policy = build_policy(run.model, mesh, run.lora)
  state, steps = setup.build_learner(run, policy, mesh)
  adapter = state.params
  assert all(
    isinstance(v, nnx.LoRAParam)
    for v in jax.tree.leaves(
      adapter, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
  )
  n_adapter = sum(x.size for x in jax.tree.leaves(adapter))
  n_base = sum(x.size for x in jax.tree.leaves(state.frozen))
  assert 0 < n_adapter < n_base / 4
  # Optimizer state: Adam's two moments of the adapters (+ scalar counts).
  n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state))
  assert 2 * n_adapter <= n_opt <= 2 * n_adapter + 8
  before_adapter = jax.device_get(adapter)
  before_frozen = jax.device_get(state.frozen)
  pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(state.frozen)]
  arrays = step_arrays(run, 1)
  with jax.set_mesh(mesh):
    dev = batch_lib.to_device(mesh, arrays)
    _, train_arrays, _ = steps.prepare(
      state.policy_params(), None, state.kl_ctrl, None, dev
    )
    state, metrics = steps.update(state, train_arrays)
  assert float(metrics['actor/grad_norm']) > 0
  # Two updates: B moves first (A's gradient is 0 while B = 0), then A.
  moved = jax.tree.map(
    lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))),
    before_adapter,
    jax.device_get(state.params),
  )
  assert all(jax.tree.leaves(moved))
  for a, b in zip(
    jax.tree.leaves(before_frozen),
    jax.tree.leaves(jax.device_get(state.frozen)),
  ):
    np.testing.assert_array_equal(a, b)
  # Donated and returned as is: the same device buffers, no per-step copy.
  after = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(state.frozen)]
  assert after == pointers


def test_lora_config_refuses_sft_and_engine_quant():
  with pytest.raises(ValueError, match=r'config\.train\.sft_steps.*lora'):
    build.build(pulse_config(lora__rank=2, train__sft_steps=2))
  with pytest.raises(ValueError, match=r'config\.rollout\.engine_quant'):
    build.build(
      pulse_config(
        lora__rank=2, train__sft_steps=0, rollout__engine_quant='int8'
      )
    )
