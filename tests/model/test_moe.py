"""`jaxcorr.model.moe`: grouped dispatch, routing replay, balance stats."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcorr import sharding as sh
from jaxcorr.model import Transformer, TransformerConfig
from jaxcorr.model.moe import NO_EXPERT, balance_stats, route
from tests.helpers.model_testing import shard_batch


def moe_config(**changes) -> TransformerConfig:
  base = dict(
    architecture='Qwen3MoeForCausalLM',
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    qk_norm=True,
    num_experts=8,
    num_experts_per_tok=2,
    mlp_only_layers=(0,),
    initializer_range=0.3,
  )
  base.update(changes)
  return TransformerConfig(**base)


@nnx.jit
def routed(model, tokens, replay=None, token_mask=None):
  h, _, stats = model.routed_hidden_states(
    tokens, replay=replay, token_mask=token_mask
  )
  return model.logits(h), stats


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 8)))


def test_grouped_dispatch_equals_dense_reference_values_and_grads():
  cfg = moe_config(shared_expert_intermediate_size=0)
  grouped = Transformer(cfg, rngs=nnx.Rngs(0))
  dense = Transformer(cfg.replace(moe_dispatch='dense'), rngs=nnx.Rngs(0))
  a, sa = routed(grouped, TOKENS)
  b, sb = routed(dense, TOKENS)
  np.testing.assert_allclose(a, b, atol=1e-5)
  np.testing.assert_array_equal(sa.experts, sb.experts)
  assert sa.experts.shape == (2, 8, 2, 2)  # [B, S, L_moe, k]

  @nnx.jit
  def grad(model):
    return nnx.grad(lambda m: jnp.sum(jnp.tanh(routed(m, TOKENS)[0])))(model)

  ga = nnx.state(grad(grouped), nnx.Param)
  gb = nnx.state(grad(dense), nnx.Param)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(x, y, atol=1e-4, rtol=1e-5)


def test_replaying_own_routing_is_exact_and_other_sets_are_used():
  model = Transformer(moe_config(), rngs=nnx.Rngs(1))
  logits, stats = routed(model, TOKENS)
  again, st2 = routed(model, TOKENS, stats.experts)
  np.testing.assert_array_equal(again, logits)
  np.testing.assert_array_equal(st2.experts, stats.experts)
  # A different set in the last MoE layer only: that layer uses it; the
  # first MoE layer (unchanged replay) routes exactly as before.
  other = stats.experts.at[:, :, 1].set((stats.experts[:, :, 1] + 1) % 8)
  changed, st3 = routed(model, TOKENS, other)
  np.testing.assert_array_equal(st3.experts, other)
  np.testing.assert_array_equal(st3.natural[:, :, 0], stats.natural[:, :, 0])
  assert np.abs(np.asarray(changed - logits)).max() > 1e-3
  # Sentinel rows route freely (padding, an all-padding micro-batch).
  none = jnp.full_like(stats.experts, NO_EXPERT)
  free, st4 = routed(model, TOKENS, none)
  np.testing.assert_array_equal(free, logits)
  np.testing.assert_array_equal(st4.experts, stats.experts)


def test_router_gets_gradients_under_replay():
  model = Transformer(moe_config(), rngs=nnx.Rngs(2))
  _, stats = routed(model, TOKENS)

  @nnx.jit
  def grad(model, replay):
    def loss(m):
      return jnp.sum(jnp.tanh(routed(m, TOKENS, replay)[0]))

    return nnx.grad(loss)(model)

  g = grad(model, stats.experts)
  for layer in (1, 2):
    router = g.layers[layer].mlp.router[...]
    assert float(jnp.abs(router).max()) > 0


def test_route_gates_and_balance_stats():
  logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
  experts, gates, _ = route(logits, 2, norm_topk_prob=True)
  np.testing.assert_array_equal(experts, [[0, 1], [2, 3]])
  np.testing.assert_allclose(gates.sum(-1), 1.0, atol=1e-6)
  _, plain, _ = route(logits, 2, norm_topk_prob=False)
  p = jax.nn.softmax(logits, -1)
  np.testing.assert_allclose(plain[0], p[0, :2], atol=1e-6)
  replay = jnp.asarray([[3, 2], [NO_EXPERT, NO_EXPERT]])
  used, g, _ = route(logits, 2, True, replay)
  np.testing.assert_array_equal(used, [[3, 2], [2, 3]])
  np.testing.assert_allclose(g[0], jax.nn.softmax(jnp.asarray([-1.0, 0.0])))
  # Uniform router, balanced choice: aux = 1; masked-out rows do not count.
  flat = jnp.zeros((4, 4))
  nat = jnp.asarray([[0, 1], [2, 3], [0, 1], [0, 0]])
  aux, z, load = balance_stats(flat, nat, jnp.asarray([1, 1, 0, 0], bool))
  np.testing.assert_allclose(aux, 1.0, atol=1e-6)
  np.testing.assert_allclose(load, [0.25] * 4)
  np.testing.assert_allclose(z, np.log(4.0) ** 2, atol=1e-5)
  aux0, _, _ = balance_stats(flat, nat, jnp.zeros((4,), bool))
  assert float(aux0) == 0.0


@pytest.mark.slow
def test_scanned_moe_layers_match_the_list():
  cfg = moe_config(mlp_only_layers=(), num_layers=2)
  listed = Transformer(cfg, rngs=nnx.Rngs(3))
  scanned = Transformer(cfg.replace(scan_layers=True), rngs=nnx.Rngs(3))
  state = nnx.state(listed, nnx.Param)
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *state['layers'].values())
  nnx.update(scanned.layers, stacked)
  nnx.update(scanned, {k: v for k, v in state.items() if k != 'layers'})
  a, sa = routed(listed, TOKENS)
  b, sb = routed(scanned, TOKENS, sa.experts)
  np.testing.assert_allclose(a, b, atol=1e-5)
  np.testing.assert_array_equal(sa.experts, sb.experts)


@pytest.mark.slow  # 8-device compile: the test budget
def test_sharded_forward_and_gradients_equal_single_device():
  """Experts split over fsdp=8 (one per device): logits, routing and every
  gradient (under replay) as on one device."""
  model = Transformer(moe_config(), rngs=nnx.Rngs(4))
  graphdef, state = nnx.split(model)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (8, 8)))
  replay = routed(model, tokens)[1].experts[::-1]  # another row's sets

  def run(state, tokens, replay):
    def loss(state):
      m = nnx.merge(graphdef, state)
      h, _, stats = m.routed_hidden_states(tokens, replay=replay)
      logits = m.logits(h)
      return jnp.sum(jnp.tanh(logits)) + stats.aux_loss.sum(), (logits, stats)

    (_, out), grads = jax.value_and_grad(loss, has_aux=True)(state)
    return out, grads

  ref = jax.jit(run)(state, tokens, replay)
  mesh = sh.make_mesh(dict(fsdp=8))
  placed = jax.device_put(state, sh.param_shardings(state, mesh))
  up = placed['layers'][1]['mlp']['up_proj'].get_value()
  assert up.addressable_shards[0].data.shape == (1, 32, 16)  # really split
  with jax.set_mesh(mesh):
    got = jax.jit(run)(placed, shard_batch(tokens, mesh), replay)
  np.testing.assert_allclose(got[0][0], ref[0][0], atol=2e-5, rtol=1e-5)
  np.testing.assert_array_equal(got[0][1].experts, ref[0][1].experts)
  for x, y in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1])):
    # Reduction order differs across devices: relative to the leaf's scale.
    scale = max(1.0, float(np.abs(y).max()))
    np.testing.assert_allclose(x, y, atol=1e-5 * scale, rtol=1e-4)
