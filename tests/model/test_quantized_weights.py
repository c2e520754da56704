"""Narrow engine weights (`jaxcorr.model.quantized_weights`): quantize ->
dequantize error bounds per scheme, storage bytes, the forward over a
quantized state == the forward over its dequantized weights, and the
trainer's fake-quant copy == the engine's dequantized weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcorr.model import quantized_weights as qw
from tests.helpers.model_testing import random_model, random_tokens, tiny_config

# Largest |x - dequant(quant(x))| relative to its channel's absmax: half a
# step of 127 levels for int8; e4m3 keeps 3 mantissa bits (2^-4 relative
# rounding) of values up to 448 times the scale.
BOUNDS = {'int8': 0.5 / 127, 'fp8': 2.0**-4}


@pytest.mark.parametrize('scheme', ['int8', 'fp8'])
@pytest.mark.parametrize('block', [0, 16])
def test_round_trip_error_bounds(scheme, block):
  x = jax.random.normal(jax.random.PRNGKey(0), (64, 4, 8)) * jnp.arange(
    1, 33
  ).reshape(1, 4, 8)
  spec = qw.QuantSpec(scheme, block=block)
  q = jax.jit(lambda a: qw._quantize(a, (0,), spec))(x)  # contract inputs
  assert q.weight.qvalue.dtype == spec.qtype
  assert q.weight.scale.shape == ((1 if not block else 64 // block), 4, 8)
  err = np.abs(
    np.asarray(jax.jit(q.dequantize, static_argnums=0)(jnp.float32))
    - np.asarray(x)
  )
  amax = np.abs(np.asarray(x)).max(axis=0, keepdims=True)
  assert np.all(err <= BOUNDS[scheme] * amax + 1e-7)
  assert err.max() > 0  # it did quantize


@pytest.mark.parametrize('block', [8, 64])
def test_o_proj_blocks_are_consecutive_inputs(block):
  """o_proj [H, Dh, D] contracts heads x head_dim, flattened head-major:
  each scale covers `block` consecutive inputs of one output channel, a
  part of one head (block 8 of Dh 32) or whole heads (64: two heads), as
  the docs say; it was one scale shared by every head's slice."""
  h, dh, d = 4, 32, 6
  x = jax.random.normal(jax.random.PRNGKey(1), (h, dh, d))
  x = x * jnp.arange(1, h * dh + 1).reshape(h, dh, 1)  # heads differ
  q = qw._quantize(x, (0, 1), qw.QuantSpec('int8', block=block))
  flat = np.abs(np.asarray(x)).reshape(h * dh // block, block, d)
  scale = np.asarray(q.weight.scale).reshape(h * dh // block, d)
  # qwix's absmax scale: the block's absmax over its step count.
  np.testing.assert_allclose(scale * 127.5, flat.max(1), rtol=1e-6)


def test_a_block_that_tiles_no_weight_is_refused():
  model = nnx.eval_shape(lambda: random_model(tiny_config()))
  assert qw.block_refusal(model, 16) is None
  allowed, why = qw.block_refusal(model, 7)
  assert 'o_proj contract' in why and allowed.startswith('0 ')
  with pytest.raises(ValueError, match='block 7'):
    qw._quantize(jnp.ones((4, 8, 6)), (0, 1), qw.QuantSpec('int8', block=7))


def _quantized(spec, **cfg):
  model = random_model(tiny_config(**cfg))
  graphdef, state = nnx.split(model)
  q = jax.jit(lambda s: qw.quantize_state(nnx.merge(graphdef, s), spec))(state)
  return graphdef, state, q


def test_quantized_forward_is_the_dequantized_weights_forward():
  # Stacked layers here; the engine's tests run the unstacked model.
  scan = True
  spec = qw.QuantSpec('int8')
  graphdef, state, q = _quantized(spec, scan_layers=scan)
  # Every matmul weight narrow (7 per layer, embedding, untied head);
  # norms and biases as they were.
  flat = dict(nnx.to_flat_state(q))
  narrow = {
    p for p, v in flat.items() if isinstance(v.get_value(), qw.QuantizedWeight)
  }
  assert {('embed',), ('lm_head',)} <= narrow
  assert len(narrow) == 2 + 7 * (1 if scan else 2)
  for p in narrow:
    assert flat[p].get_value().weight.qvalue.dtype == jnp.int8
  assert all(
    jnp.issubdtype(v.dtype, jnp.floating)
    for p, v in flat.items()
    if p not in narrow
  )
  # int8 + float32 per-channel scales vs the float32 model.
  assert qw.stored_bytes(q) / qw.stored_bytes(state) < 0.3
  toks = random_tokens(2, 7)
  fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
  deq = qw.dequantize_state(q, jnp.float32)
  np.testing.assert_allclose(fwd(q, toks), fwd(deq, toks), atol=1e-5)
  fake = jax.jit(
    lambda s: qw.fake_quantize(nnx.merge(graphdef, s), spec, jnp.float32)
  )(state)
  for a, b in zip(jax.tree.leaves(fake), jax.tree.leaves(deq)):
    np.testing.assert_array_equal(a, b)


def test_int8_activations_change_the_forward_a_little():
  spec = qw.QuantSpec('int8', activations=True)
  graphdef, _, q = _quantized(spec)
  toks = random_tokens(2, 7)
  fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
  w8a8, w8 = fwd(q, toks), fwd(qw.dequantize_state(q, jnp.float32), toks)
  gap = float(jnp.abs(w8a8 - w8).max())
  assert 1e-4 < gap < 0.5


def test_bad_scheme():
  with pytest.raises(ValueError, match=r"scheme.*'int8', 'fp8'"):
    qw.QuantSpec('int4')
