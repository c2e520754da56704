"""Mixed precision (jaxcorr/train/mixed_precision.py, docs/precision.md):
bf16 compute over float32 master weights equals float32 compute within
bf16's rounding, keeps the weights and AdamW's state float32, loses no tiny
update, and `model.dtype='auto'` picks float32 on CPU, bf16 on GPU / TPU.

Tolerances: bf16 keeps 8 significant bits (relative rounding 2^-9 ≈ 2e-3
per op). Measured on the one-layer random model below (log-probs around
-5, three token draws): per-token log-prob gaps up to 0.040-0.047 (mean
0.012-0.013), entropy up to 0.026, gradients 1.5-1.6% of their norm; the
limits are about 2x that. The pulse step's metrics moved by < 0.3%.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxcorr.model import token_logprobs
from jaxcorr.train import batch as batch_lib
from jaxcorr.train import build, mixed_precision, scoring
from jaxcorr.train.mixed_precision import compute_dtype
from jaxcorr.train.policy import ModelConfig, transformer_config
from jaxcorr.train.state import OptimConfig, apply_updates, make_optimizer
from tests.helpers.model_testing import (
  VOCAB,
  random_model,
  random_tokens,
  tiny_config,
  with_config,
)
from tests.helpers.step_batches import one_device_mesh, step_arrays
from tests.helpers.trainer_config import pulse_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOGP_ATOL = 0.1  # bf16 vs fp32 log-probs (and entropies), any token
LOGP_MEAN = 0.025  # ... mean over the tokens
GRAD_RTOL = 0.035  # |g_bf16 - g_fp32| / |g_fp32|, whole gradient tree
METRIC_RTOL = 0.01  # the step's loss, grad norm and correction metrics


def test_auto_resolves_by_backend():
  assert compute_dtype('auto', 'cpu') == 'float32'
  for accelerator in ('gpu', 'cuda', 'rocm', 'tpu'):
    assert compute_dtype('auto', accelerator) == 'bfloat16'
  assert compute_dtype('float32', 'tpu') == 'float32'
  assert compute_dtype('bfloat16', 'cpu') == 'bfloat16'
  with pytest.raises(ValueError, match=r"config\.model\.dtype='auto'.*'metal'"):
    compute_dtype('auto', 'metal')
  model = ModelConfig()
  assert model.dtype == 'auto'
  assert transformer_config(model, backend='tpu').dtype == jnp.bfloat16
  assert transformer_config(model, backend='tpu').param_dtype == jnp.float32
  # CPU runs keep their float32 numbers: the default resolves to float32.
  run = build.build(pulse_config())
  assert transformer_config(run.model).dtype == jnp.float32


def test_config_build_leaves_the_backend_unstarted():
  """`jaxcorr.main` builds the config before `jax.distributed.initialize`,
  which refuses a started backend: neither 'auto' nor any start-up check
  may ask JAX for its backend (a fresh process: this one's has started)."""
  code = (
    'from jax._src import xla_bridge\n'
    'from jaxcorr.train import build\n'
    'from tests.helpers.trainer_config import pulse_config\n'
    'build.build(pulse_config())\n'
    'print(xla_bridge.backends_are_initialized())\n'
  )
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu')
  out = subprocess.run(
    [sys.executable, '-c', code],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    check=True,
  )
  assert out.stdout.split()[-1] == 'False'


@pytest.mark.parametrize('field', ['dtype', 'param_dtype'])
def test_float16_refused_at_config_time(field):
  with pytest.raises(ValueError) as e:
    build.build(pulse_config(**{f'model__{field}': 'float16'}))
  msg = str(e.value)
  assert msg.startswith(f"config.model.{field}: invalid value 'float16'")
  assert 'loss scaling' in msg and "'bfloat16'" in msg


def _models():
  """A random tiny model (one layer, float32 params) and the same weights
  computing in bf16."""
  fp32 = random_model(tiny_config(num_layers=1))
  return fp32, with_config(fp32, dtype=jnp.bfloat16)


@nnx.jit
def _logp_and_grads(model, tokens):
  def loss(m):
    logp, ent = token_logprobs(m, tokens, return_entropy=True)
    return -jnp.mean(logp), (logp, ent)

  (_, (logp, ent)), grads = nnx.value_and_grad(loss, has_aux=True)(model)
  return logp, ent, grads


def _tree_rel_err(a, b) -> float:
  diff = jax.tree.map(lambda x, y: x.astype(jnp.float32) - y, a, b)
  return float(optax.tree.norm(diff) / optax.tree.norm(b))


def test_bf16_logprobs_and_grads_match_fp32():
  fp32, bf16 = _models()
  tokens = random_tokens(4, 24)
  logp32, ent32, g32 = _logp_and_grads(fp32, tokens)
  logp16, ent16, g16 = _logp_and_grads(bf16, tokens)
  # The head accumulates and normalises in float32 whatever the compute.
  assert logp16.dtype == ent16.dtype == jnp.float32
  gap = jnp.abs(logp16 - logp32)
  assert float(jnp.max(gap)) < LOGP_ATOL and float(jnp.mean(gap)) < LOGP_MEAN
  assert float(jnp.max(jnp.abs(ent16 - ent32))) < LOGP_ATOL
  assert not bool(jnp.all(logp16 == logp32))  # bf16 really computed
  # Gradients land on the float32 master weights, in float32.
  assert {x.dtype for x in jax.tree.leaves(g16)} == {jnp.dtype(jnp.float32)}
  assert _tree_rel_err(g16, g32) < GRAD_RTOL


def test_master_weights_keep_a_tiny_update():
  """One AdamW step of lr 1e-6 from bf16-computed gradients: every weight
  moves (Adam's first step is ~lr per weight) and the state stays float32;
  bf16 weights (ulp ~1e-3 at 0.15) would round nearly all moves away."""
  _, bf16 = _models()
  graphdef, params = nnx.split(bf16, nnx.Param)
  # Every id once, so every embedding row has a gradient.
  tokens = jnp.asarray(np.random.default_rng(0).permutation(VOCAB))
  tokens = tokens.reshape(4, VOCAB // 4)

  def grads_of(params):
    def loss(p):
      m = nnx.merge(graphdef, p)
      return -jnp.mean(token_logprobs(m, tokens))

    return jax.grad(loss)(params)

  tx, _ = make_optimizer(OptimConfig(weight_decay=0.0), 1e-6, 10)

  @jax.jit
  def update(params, opt_state):
    # Two micro-batches, summed as the step sums them (float32).
    acc = mixed_precision.grad_accumulator(params)
    for _ in range(2):
      acc = mixed_precision.accumulate(acc, grads_of(params))
    return apply_updates(tx, acc, opt_state, params)  # casts to params'

  new, opt_state = update(params, tx.init(params))
  for leaf in jax.tree.leaves((new, opt_state)):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert leaf.dtype == jnp.float32
  moved = [
    float(jnp.mean(a != b))
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params))
  ]
  assert min(moved) > 0.95  # 4 ids only end a row: no gradient there
  as_bf16 = [
    float(jnp.mean(a.astype(jnp.bfloat16) != b.astype(jnp.bfloat16)))
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params))
  ]
  assert max(as_bf16) < 0.1  # what bf16 master weights would have kept


def test_micro_batch_gradients_sum_in_float32():
  """bf16 gradients (bf16 params) of 64 micro-batches sum in float32: a
  bf16 running sum stalls once the increments fall below half its ulp."""
  params = {'w': jnp.ones((8,), jnp.bfloat16)}
  g = {'w': jnp.full((8,), 1e-2, jnp.bfloat16)}
  acc = mixed_precision.grad_accumulator(params)
  for _ in range(64):
    acc = mixed_precision.accumulate(acc, g)
  assert acc['w'].dtype == jnp.float32
  np.testing.assert_allclose(acc['w'], 64 * float(g['w'][0]), rtol=1e-6)
  # The float32 sum meets bf16 params: the optimizer's state keeps its
  # dtypes (a step's scan over mini-batches needs that of its carry).
  tx, _ = make_optimizer(OptimConfig(), 1e-3, 10)
  opt_state = tx.init(params)
  new, new_state = apply_updates(tx, acc, opt_state, params)
  assert new['w'].dtype == jnp.bfloat16
  dtypes = lambda t: [x.dtype for x in jax.tree.leaves(t)]  # noqa: E731
  assert dtypes(new_state) == dtypes(opt_state)


def _one_step(dtype: str):
  """prepare + update of the pulse run (decoupled token IS, 2 micro-batches)
  on the synthetic batch with its simulated engine mismatch."""
  from tests.helpers.model_testing import fresh_train_state

  run = build.build(
    pulse_config(
      'decoupled_token_is',
      model__dtype=dtype,
      train__shuffle_minibatches=False,
      train__micro_batches=2,
    )
  )
  mesh = one_device_mesh()
  state, steps = fresh_train_state(run, mesh)
  with jax.set_mesh(mesh):
    dev = batch_lib.to_device(mesh, step_arrays(run, 1))
    _, train, prep = steps.prepare(state.params, None, state.kl_ctrl, None, dev)
    old_logp = jax.device_get(train.old_logp)
    state, upd = steps.update(state, train)
  return old_logp, jax.device_get({**prep, **upd}), state


@pytest.fixture(scope='module')
def steps():
  return _one_step('float32'), _one_step('bfloat16')


def test_bf16_step_matches_fp32(steps):
  (logp32, met32, _), (logp16, met16, _) = steps
  assert float(np.max(np.abs(logp16 - logp32))) < LOGP_ATOL
  keys = [
    k
    for k in met32
    if k.startswith(('actor/', 'rollout_corr/')) and np.ndim(met32[k]) == 0
  ]
  assert 'actor/grad_norm' in keys and 'rollout_corr/k3_kl' in keys
  for k in keys:
    np.testing.assert_allclose(
      met16[k], met32[k], rtol=METRIC_RTOL, atol=1e-3, err_msg=k
    )


def test_bf16_step_keeps_float32_state(steps):
  _, (_, _, state) = steps
  floats = [
    x
    for x in jax.tree.leaves((state.params, state.opt_state))
    if jnp.issubdtype(x.dtype, jnp.floating)
  ]
  assert floats and {x.dtype for x in floats} == {jnp.dtype(jnp.float32)}


def test_exact_mode_scores_in_the_engine_dtype():
  """`rollout.exact`'s π_old is the engine's model (`engine_model`): the
  trainer's compute dtype does not reach it, so μ == π_old stays bit for
  bit under a bf16 trainer (docs/rollout.md, "Exact mode")."""
  run = build.build(pulse_config(rollout__exact=True))
  fp32, bf16 = _models()
  a = scoring.engine_model(run, *nnx.split(fp32))
  b = scoring.engine_model(run, *nnx.split(bf16))
  assert a.config == b.config and a.config.dtype == jnp.float32
  for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
    assert x.dtype == y.dtype and bool(jnp.all(x == y))
