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
from tests.helpers.step_batches import (
  one_device_mesh,
  step_arrays,
  synthetic_rollout,
)
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


def test_lora_config_refuses_sft_and_simulated_quant():
  with pytest.raises(ValueError, match=r'config\.train\.sft_steps.*lora'):
    build.build(pulse_config(lora__rank=2, train__sft_steps=2))
  with pytest.raises(ValueError, match=r'config\.rollout\.simulated_quant'):
    build.build(
      pulse_config(
        lora__rank=2, train__sft_steps=0, rollout__simulated_quant='int8'
      )
    )


def test_moe_adapters_train_under_rollout_routing_replay():
  """R3 + LoRA on a Mixtral policy: the update trains the adapters only,
  expert adapters included, and routes by the engine's sets: an expert the
  replayed routing never picks keeps its adapter exactly."""
  e = 8
  run = build.build(
    pulse_config(
      'decoupled_token_is',
      train__sft_steps=0,
      train__mini_batches=1,
      train__shuffle_minibatches=False,
      model__architecture='MixtralForCausalLM',
      model__num_experts=e,
      model__num_experts_per_tok=2,
      moe__router_replay='rollout',
      optim__warmup_steps=0,
      lora__rank=4,
      lora__target_modules='q_proj,gate_proj,up_proj,down_proj',
    )
  )
  mesh = one_device_mesh()
  policy = build_policy(run.model, mesh, run.lora)
  state, steps = setup.build_learner(run, policy, mesh)
  rb, rew = synthetic_rollout()
  s = rb.prompt_tokens.shape[1] + rb.response_tokens.shape[1]
  shape = (rb.batch_size, s, run.model.num_layers, e - 1)
  rng = np.random.default_rng(5)  # distinct top-2 sets, never expert e - 1
  routed = np.argsort(rng.random(shape), -1)[..., :2].astype(np.int32)
  host = batch_lib.assemble(
    rb.replace(routed_experts=routed),
    rew,
    trainer_version=0,
    max_staleness=None,
    logprob_mode='full',
    row_multiple=1,
  )
  before = jax.device_get(state.params)
  with jax.set_mesh(mesh):
    dev = batch_lib.to_device(mesh, host)
    _, train_arrays, _ = steps.prepare(
      state.policy_params(), None, state.kl_ctrl, None, dev
    )
    state, metrics = steps.update(state, train_arrays)
  assert float(metrics['actor/grad_norm']) > 0
  after = nnx.to_pure_dict(jax.device_get(state.params))['layers']
  before = nnx.to_pure_dict(before)['layers']
  for i in range(run.model.num_layers):
    for name in ('gate_proj', 'up_proj', 'down_proj'):
      # B moves first (A's gradient is 0 while B = 0), per expert.
      b0, b1 = (
        np.asarray(t[i]['mlp'][name]['lora']['lora_b']) for t in (before, after)
      )
      assert b0.shape[0] == e
      moved = np.abs(b1 - b0).reshape(e, -1).max(-1) > 0
      assert moved.tolist() == [True] * (e - 1) + [False], (i, name)
    q0, q1 = (
      np.asarray(t[i]['attn']['q_proj']['lora']['lora_b'])
      for t in (before, after)
    )
    assert np.any(q0 != q1)
