"""jaxcorr.sharding: the mesh, the logical rules, and a sharded model over the
8 fake CPU devices equal to the same model on one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcorr import sharding as sh
from jaxcorr.model import Transformer, token_logprobs
from jaxcorr.train.state import init_optimizer, optimizer_shardings
from tests.helpers.model_testing import (
  random_model,
  random_tokens,
  shard_batch,
  stack_layers,
  tiny_config,
)

# -------------------------------------------------------------------- mesh


@pytest.mark.parametrize(
  'config, shape',
  [
    (None, (1, 8, 1, 1)),
    (dict(fsdp=2, tensor=-1), (1, 2, 1, 4)),
    (sh.MeshConfig(data=2, fsdp=-1, tensor=2), (2, 2, 1, 2)),
    (ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=4)), (2, 1, 1, 4)),
  ],
)
def test_make_mesh_shapes(config, shape):
  mesh = sh.make_mesh(config)
  assert mesh.axis_names == sh.MESH_AXES
  assert tuple(mesh.shape.values()) == shape
  assert mesh.axis_types == (AxisType.Auto,) * 4


@pytest.mark.parametrize(
  'config, match',
  [
    (dict(data=-1, fsdp=-1), 'at most one'),
    (dict(fsdp=3, tensor=-1), 'do not divide'),
    (dict(data=2, fsdp=2, tensor=1), 'needs 4 devices'),
    (dict(tensor=0), 'positive'),
  ],
)
def test_make_mesh_rejects_bad_shapes(config, match):
  with pytest.raises(ValueError, match=match):
    sh.make_mesh(config)


def test_make_mesh_on_a_device_subset():
  mesh = sh.make_mesh(dict(tensor=2), devices=jax.devices()[:4])
  assert tuple(mesh.shape.values()) == (1, 2, 1, 2)


# ------------------------------------------------------------------- rules


def test_logical_rules():
  mesh = sh.make_mesh(dict(data=2, fsdp=2, tensor=2))

  def spec(axes, shape=None):
    return sh.logical_to_spec(axes, shape=shape, mesh=mesh)

  assert spec(('embed', 'mlp')) == P('fsdp', 'tensor')
  assert spec(('heads', 'head_dim', 'embed')) == P('tensor', None, 'fsdp')
  assert spec(('layers', 'vocab', 'embed')) == P(None, 'tensor', 'fsdp')
  assert spec(('batch', 'seq', 'act_embed')) == P(('data', 'fsdp'), None, None)
  # A mesh axis serves one dimension only.
  assert spec(('mlp', 'heads')) == P('tensor', None)
  # Dimensions a mesh axis does not divide stay whole on it.
  assert spec(('kv_heads', 'head_dim'), (3, 8)) == P(None, None)
  assert spec(('batch', 'seq'), (6, 8)) == P('data', None)
  assert spec(('batch', 'seq'), (8, 8)) == P(('data', 'fsdp'), None)
  # Without a mesh, the table alone.
  assert sh.logical_to_spec(('vocab', None)) == P('tensor', None)
  with pytest.raises(KeyError, match='no rule'):
    sh.logical_to_spec(('not_an_axis',))


def test_constrain_is_a_noop_without_a_mesh():
  x = jnp.ones((4, 8))
  assert sh.constrain(x, ('batch', 'act_mlp')) is x


# ------------------------------------------------- params, optimizer, batch


def _expected(var, mesh):
  axes = var.get_metadata()['logical_axes']
  return NamedSharding(
    mesh, sh.logical_to_spec(axes, shape=var.shape, mesh=mesh)
  )


def test_param_and_optimizer_shardings():
  mesh = sh.make_mesh(dict(fsdp=2, tensor=4))
  cfg = tiny_config(scan_layers=True)
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  shardings = sh.param_shardings(model, mesh)
  flat = dict(nnx.to_flat_state(shardings))
  for path, var in nnx.to_flat_state(params):
    assert flat[path].get_value() == _expected(var, mesh), path
  q = flat[('layers', 'attn', 'q_proj', 'kernel')].get_value()
  assert q.spec == P(None, 'fsdp', 'tensor', None)
  k = flat[('layers', 'attn', 'k_proj', 'kernel')].get_value()
  assert k.spec == P(None, 'fsdp', None, None)  # 2 KV heads, tensor = 4

  tx = optax.adamw(1e-3)
  opt_shardings = optimizer_shardings(
    tx,
    jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      params,
      shardings,
    ),
    mesh,
  )
  adam = opt_shardings[0]
  assert adam.count == NamedSharding(mesh, P())
  for moments in (adam.mu, adam.nu):
    got = dict(nnx.to_flat_state(moments))
    for path, s in flat.items():
      assert got[path].get_value() == s.get_value(), path
  # Usable as out_shardings: the optimizer state is born sharded.
  real = random_model(cfg)
  placed = jax.device_put(nnx.state(real, nnx.Param), shardings)
  state = init_optimizer(tx, placed, mesh)
  mu_q = state[0].mu['layers']['attn']['q_proj']['kernel'].get_value()
  assert mu_q.sharding.spec == q.spec
  assert mu_q.addressable_shards[0].data.shape == (2, 32, 2, 8)


def test_shard_batch():
  mesh = sh.make_mesh(dict(data=2, fsdp=2, tensor=2))
  batch = {'tokens': np.zeros((8, 5), np.int32), 'temp': np.float32(1.0)}
  out = shard_batch(batch, mesh)
  assert out['tokens'].sharding.spec == P(('data', 'fsdp'), None)
  assert out['tokens'].addressable_shards[0].data.shape == (2, 5)
  assert out['temp'].sharding.spec == P()
  with pytest.raises(ValueError, match='does not split'):
    shard_batch({'x': np.zeros((6, 2))}, mesh)


def test_init_sharded_places_every_param():
  mesh = sh.make_mesh(dict(fsdp=2, tensor=4))
  cfg = tiny_config(num_layers=1, scan_layers=True, qkv_bias=False)
  model = sh.init_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    assert var.get_value().sharding == _expected(var, mesh), path
  up = model.layers.mlp.up_proj.kernel.get_value()
  assert up.addressable_shards[0].data.shape == (1, 32, 32)
  assert float(jnp.std(up)) == pytest.approx(cfg.initializer_range, rel=0.2)


# ------------------------------------------------- sharded == single device


def test_sharded_forward_and_gradients_equal_single_device():
  """fsdp=2 x tensor=4: logits, log-probs and every gradient as on one
  device. (Scanned layers under a mesh: tests/model/test_hf_io.py.)"""
  model = random_model(tiny_config())
  tokens = random_tokens(4, 16)
  weights = jax.random.normal(jax.random.key(0), (4, 15))
  graphdef, state = nnx.split(model)

  def run(state, tokens):
    def loss(state):
      m = nnx.merge(graphdef, state)
      lp = token_logprobs(m, tokens, temperature=0.7, chunk_size=4)
      return jnp.sum(weights * lp), lp

    (_, lp), grads = jax.value_and_grad(loss, has_aux=True)(state)
    return nnx.merge(graphdef, state)(tokens), lp, grads

  ref = jax.jit(run)(state, tokens)

  mesh = sh.make_mesh(dict(fsdp=2, tensor=4))
  shardings = sh.param_shardings(state, mesh)
  sharded_state = jax.device_put(state, shardings)
  q = sharded_state['layers'][0]['attn']['q_proj']['kernel'].get_value()
  assert q.addressable_shards[0].data.shape == (32, 2, 8)  # really split
  with jax.set_mesh(mesh):
    got = jax.jit(run)(sharded_state, shard_batch(tokens, mesh))
  logits = got[0]
  assert logits.sharding.spec[0] == 'fsdp'  # batch stayed split
  assert len({s.device for s in logits.addressable_shards}) == 8
  np.testing.assert_allclose(logits, ref[0], atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(got[1], ref[1], atol=2e-5)
  g_ref, g_got = stack_layers(ref[2]), stack_layers(got[2])
  for k in g_ref:
    # float32 reordering noise scales with the summed terms, not the sum:
    # the tied embedding's gradient (up to ~24 here) sums every position's
    # head and lookup terms, so a near-zero entry of it carries ~6e-5.
    atol = max(2e-5, 4e-6 * float(np.abs(g_ref[k]).max()))
    np.testing.assert_allclose(
      g_got[k], g_ref[k], atol=atol, rtol=1e-4, err_msg=str(k)
    )
