"""Router replay in the jitted step (`moe.router_replay`, docs/moe.md).

A tiny scratch Mixtral policy (8 experts, top-2) through `Steps.prepare` +
`Steps.update` on the synthetic rollout batch of the step tests, with the
engine's routing attached as `RolloutBatch.routed_experts`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcorr.model.moe import NO_EXPERT
from jaxcorr.train import batch as batch_lib
from jaxcorr.train import build
from tests.helpers.model_testing import fresh_train_state
from tests.helpers.step_batches import one_device_mesh, synthetic_rollout
from tests.helpers.tolerance import TOL_LAYOUT, TOL_LAYOUT_METRICS, assert_close
from tests.helpers.trainer_config import pulse_config

E, K = 8, 2


def moe_run(replay: str, **train):
  overrides = {f'train__{k}': v for k, v in train.items()}
  return build.build(
    pulse_config(
      'decoupled_token_is',
      train__shuffle_minibatches=False,
      train__mini_batches=1,
      model__architecture='MixtralForCausalLM',
      model__num_experts=E,
      model__num_experts_per_tok=K,
      moe__router_replay=replay,
      moe__aux_loss_coef=0.01,
      moe__z_loss_coef=0.001,
      optim__warmup_steps=0,  # a first update that moves the params
      **overrides,
    )
  )


def arrays(run, multiple, routed=None):
  rb, rew = synthetic_rollout()
  if routed is None:  # random distinct top-2 sets, as an engine would send
    rng = np.random.default_rng(5)
    s = rb.prompt_tokens.shape[1] + rb.response_tokens.shape[1]
    shape = (rb.batch_size, s, run.model.num_layers, E)
    routed = np.argsort(rng.random(shape), -1)[..., :K].astype(np.int32)
  rb = rb.replace(routed_experts=routed)
  return batch_lib.assemble(
    rb,
    rew,
    trainer_version=0,
    max_staleness=None,
    logprob_mode='full',
    row_multiple=multiple,
  )


def step(run, host):
  mesh = one_device_mesh()
  state, steps = fresh_train_state(run, mesh, sharded=True)
  with jax.set_mesh(mesh):
    dev = batch_lib.to_device(mesh, host)
    _, train_arrays, prep = steps.prepare(
      state.params, None, state.kl_ctrl, None, dev
    )
    before = jax.device_get(state.params)  # the update donates the state
    new, upd = steps.update(state, train_arrays)
  got = (before, *jax.device_get((new.params, {**prep, **upd})))
  return got, steps.graphdef


def test_padding_and_all_padding_micro_batches_change_nothing():
  """8 rows in 8 micro-batches vs the same + 8 PAD rows in 16 (8 micro-
  batches of padding only, replay all NO_EXPERT: SkyRL #1811)."""
  run_a = moe_run('rollout', micro_batches=8)
  run_b = moe_run('rollout', micro_batches=16)
  plain, padded = arrays(run_a, 1), arrays(run_b, 16)
  assert (padded.routed_experts[8:] == NO_EXPERT).all()
  ((_, pa, ma), _), ((_, pb, mb), _) = step(run_a, plain), step(run_b, padded)
  for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
    assert_close(x, y, TOL_LAYOUT)
  assert set(ma) == set(mb)
  for k in ma:
    assert_close(ma[k], mb[k], TOL_LAYOUT_METRICS, what=k)
  assert float(ma['actor/loss_token_count']) > 0  # a real update
  assert {'moe/aux_loss', 'moe/router_agreement', 'moe/load/e7'} <= set(ma)
  assert 'moe/agreement/layer1' in ma


@pytest.mark.slow
def test_replaying_the_policys_own_routing_is_the_unreplayed_step():
  run_none = moe_run('none')
  (p0, p_none, _), graphdef = step(run_none, arrays(run_none, 1))
  # The engine's routing == the policy's own at the step's params.
  host = arrays(run_none, 1)
  model = nnx.merge(graphdef, p0)
  _, _, stats = model.routed_hidden_states(
    jnp.asarray(host.tokens), segment_ids=jnp.asarray(host.segment_ids)
  )
  own = np.where(
    host.segment_ids[..., None, None] != 0, np.asarray(stats.experts), -1
  )
  run_r3 = moe_run('rollout')
  (_, p_r3, m_r3), _ = step(run_r3, arrays(run_r3, 1, routed=own))
  for x, y in zip(jax.tree.leaves(p_none), jax.tree.leaves(p_r3)):
    assert_close(x, y, TOL_LAYOUT)
  moved = [
    np.abs(np.asarray(x) - np.asarray(y)).max() > 0
    for x, y in zip(jax.tree.leaves(p0), jax.tree.leaves(p_r3))
  ]
  assert np.mean(moved) > 0.8  # the update moved (unused experts do not)
  assert float(m_r3['moe/router_agreement']) == 1.0
  assert float(m_r3['moe/tokens_differing']) == 0.0
  # The routers trained (gates are differentiable under replay).
  for layer in range(run_r3.model.num_layers):
    before = p0['layers'][layer]['mlp']['router']
    after = p_r3['layers'][layer]['mlp']['router']
    assert np.abs(np.asarray(after) - np.asarray(before)).max() > 0
  # A random engine routing: the replayed step differs, agreement < 1.
  (_, p_rand, m_rand), _ = step(run_r3, arrays(run_r3, 1))
  assert float(m_rand['moe/router_agreement']) < 0.5
  diff = max(
    np.abs(np.asarray(x) - np.asarray(y)).max()
    for x, y in zip(jax.tree.leaves(p_none), jax.tree.leaves(p_rand))
  )
  assert diff > 1e-6
