"""A quantized engine (`rollout.quantization`, jaxcorr/rollout/precision.py)
end to end: its weights live in int8 on the engine's devices, each token's μ
is the log-prob of the quantized model that sampled it (== a reference
forward of that version's dequantized weights), an in-flight swap
re-quantizes on device (scales recomputed, per-token versions intact) and
no swap recompiles anything."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcorr.model import quantized_weights as qw
from jaxcorr.rollout import driver, precision
from jaxcorr.rollout.decoder import Decoder, Request
from jaxcorr.rollout.engine import PolicyEngine, SamplingParams
from tests.helpers.model_testing import logprobs, random_model, tiny_config
from tests.helpers.rollout_testing import compile_count

PROMPTS = [[3, 4, 5], [7], [9] * 9, [20, 21, 22, 23, 24]]
NEW, TARGET = 12, 32
SPEC = qw.QuantSpec('int8')


def _moved(model, seed):
  """`model`'s state after a policy update (every weight moves ~5%)."""
  state = nnx.state(model)
  leaves, tree = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(
    tree,
    [
      x + 0.05 * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
      for x, k in zip(leaves, keys)
    ],
  )


@pytest.fixture(scope='module')
def run():
  """Requests admitted under version 0, a swap to version 1 after one
  chunk and back to version 0's weights as version 2 after another."""
  model = random_model(tiny_config())
  engine = PolicyEngine(
    model,
    max_concurrent_decodes=8,
    max_prefill_length=16,
    max_target_length=TARGET,
    decode_chunk=4,
    quantization=SPEC,
  )
  states = [nnx.state(model), _moved(model, 7), nnx.state(model)]
  dec = Decoder(engine, sp=SamplingParams(temperature=1.0), max_new_tokens=NEW)
  keys = np.asarray(jax.random.split(jax.random.PRNGKey(1), len(PROMPTS)))
  for i, p in enumerate(PROMPTS):
    dec.submit(Request(i, i, 0, p, keys[i]))
  compiles = []
  done = dec.advance()
  for version in (1, 2):
    dec.swap(states[version], version, recompute=True)
    done += dec.advance()
    compiles.append(compile_count(engine))
  while dec.busy:
    done += dec.advance()
  return model, engine, states, sorted(done, key=lambda r: r.row), compiles


def test_weights_are_stored_narrow_on_the_engine(run):
  _, engine, *_ = run
  flat = dict(nnx.to_flat_state(engine.params))
  kernel = flat[('layers', 0, 'attn', 'q_proj', 'kernel')].get_value()
  assert isinstance(kernel, qw.QuantizedWeight)
  assert kernel.weight.qvalue.dtype == jnp.int8
  assert kernel.weight.scale.dtype == jnp.float32
  assert kernel.weight.scale.shape == (1, 8, 8)  # per output channel
  assert isinstance(kernel.weight.qvalue, jax.Array)  # on device


def test_the_batch_names_the_stored_dtypes(run):
  """`RolloutBatch.param_dtype` / `kv_cache_dtype` name what the engine
  stores (they named its compute dtype, float32, for an int8 engine)."""
  model, engine, _, done, _ = run
  batch = driver.to_batch(engine, done, NEW, SamplingParams())
  assert (batch.param_dtype, batch.kv_cache_dtype) == ('int8', 'float32')
  narrow = PolicyEngine(
    model,
    max_concurrent_decodes=2,
    max_prefill_length=16,
    max_target_length=TARGET,
    dtype='bfloat16',
    quantization=qw.QuantSpec('fp8'),
    kv_cache_dtype='int8',
  )
  assert precision.stored_dtypes(narrow) == {
    'param_dtype': 'float8_e4m3fn',
    'kv_cache_dtype': 'int8',
  }


def test_mu_is_the_dequantized_models_logprob_per_version(run):
  model, engine, states, done, _ = run
  graphdef = nnx.graphdef(model)
  refs = [
    nnx.merge(
      graphdef, qw.dequantize_state(engine.weights.quantize(s), jnp.float32)
    )
    for s in states
  ]
  seen = set()
  for req in done:
    assert len(req.tokens) == len(req.versions) > 0
    assert req.versions == sorted(req.versions)  # versions only move on
    seen.update(req.versions)
    seq = list(req.prompt) + req.tokens
    padded = jnp.asarray([seq + [0] * (TARGET - len(seq))])
    p = len(req.prompt)
    for v in set(req.versions):
      lp = np.asarray(logprobs(refs[v], padded, temperature=1.0))[0]
      rows = [t for t, tv in enumerate(req.versions) if tv == v]
      want = lp[p - 1 : p - 1 + len(req.tokens)][rows]
      np.testing.assert_allclose(np.asarray(req.logp)[rows], want, atol=1e-5)
  assert seen == {0, 1, 2}


def test_swaps_requantize_without_recompiling(run):
  _, engine, _, _, compiles = run
  assert compiles[0] == compiles[1]  # the second swap compiled nothing
  assert engine.policy_version == 2
  # Version 2 holds version 0's weights again: scales recomputed from
  # the published weights at each swap (version 1's differ).
  states = run[2]
  v0 = _kernel(engine.weights.quantize(states[0]))
  v1 = _kernel(engine.weights.quantize(states[1]))
  np.testing.assert_array_equal(_kernel(engine.params).scale, v0.scale)
  np.testing.assert_array_equal(_kernel(engine.params).qvalue, v0.qvalue)
  assert not np.array_equal(v0.scale, v1.scale)
  assert engine.weights.quantize.last_seconds > 0


def _kernel(state):
  flat = dict(nnx.to_flat_state(state))
  return flat[('layers', 0, 'mlp', 'up_proj', 'kernel')].get_value().weight


def test_kv_storage_names():
  assert precision.kv_storage_dtype('model') is None
  assert precision.kv_storage_dtype('int8') == jnp.int8
  assert precision.kv_storage_dtype('fp8') == jnp.float8_e4m3fn
  assert precision.kv_storage_dtype('bfloat16') == jnp.bfloat16


def test_fp8_activations_need_fp8_matmuls():
  w8a8 = qw.QuantSpec('fp8', activations=True)
  assert 'fp8 matmuls' in precision.unsupported(w8a8, 'cpu')
  assert precision.unsupported(w8a8, 'gpu') is None
  assert precision.unsupported(qw.QuantSpec('fp8'), 'cpu') is None
  assert (
    precision.unsupported(qw.QuantSpec('int8', activations=True), 'tpu') is None
  )
