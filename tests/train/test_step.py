"""The jitted step: padding rows, micro-batching and sharding change nothing.

One synthetic rollout batch (random tokens, a simulated engine mismatch in
`rollout_logp`) goes through `Steps.prepare` + `Steps.update` under several
layouts; losses, metrics and updated params must agree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import arith_tiny
from jaxcorr import sharding
from jaxcorr.losses import rewards
from jaxcorr.model import Transformer
from jaxcorr.rollout.types import FinishReason, RolloutBatch
from jaxcorr.train import batch as batch_lib
from jaxcorr.train import run_config as run_lib
from jaxcorr.train.setup import model_config
from jaxcorr.train.state import make_optimizer
from jaxcorr.train.step import Steps
from tests.helpers.model_testing import fresh_train_state

B, P, T = 8, 6, 5


def _run(preset: str, **train):
  c = arith_tiny.get_config('pulse+' + preset)
  c.train.shuffle_minibatches = False
  for k, v in train.items():
    c.train[k] = v
  return run_lib.build(c)


def _rollout(seed: int = 0) -> tuple[RolloutBatch, np.ndarray]:
  rng = np.random.default_rng(seed)
  plen = rng.integers(2, P + 1, B)
  rlen = rng.integers(1, T + 1, B)
  prompt_mask = np.arange(P)[None] >= (P - plen)[:, None]
  mask = np.arange(T)[None] < rlen[:, None]
  logp = np.where(mask, -rng.uniform(0.1, 3.0, (B, T)), 0).astype(np.float32)
  batch = RolloutBatch(
    prompt_tokens=np.where(prompt_mask, rng.integers(3, 20, (B, P)), 0).astype(
      np.int32
    ),
    prompt_mask=prompt_mask,
    response_tokens=np.where(mask, rng.integers(3, 20, (B, T)), 0).astype(
      np.int32
    ),
    context_mask=mask,
    response_mask=mask,
    rollout_logp=logp,
    rollout_logp_truncated=logp,
    temperature=np.ones(B, np.float32),
    top_k=np.zeros(B, np.int32),
    top_p=np.ones(B, np.float32),
    min_p=np.zeros(B, np.float32),
    policy_version=np.where(mask, 0, -1).astype(np.int32),
    finish_reason=np.full(B, FinishReason.STOP, np.int8),
    group_id=np.repeat(np.arange(B // 4), 4).astype(np.int32),
    sample_id=np.tile(np.arange(4), B // 4).astype(np.int32),
  )
  return batch, rng.integers(0, 2, B).astype(np.float32)


def _step(run, mesh, arrays):
  state, steps = fresh_train_state(run, mesh, sharded=True)
  with jax.set_mesh(mesh):
    dev = batch_lib.to_device(mesh, arrays)
    _, train_arrays, prep = steps.prepare(
      state.params, None, state.kl_ctrl, None, dev
    )
    state, upd = steps.update(state, train_arrays)
  metrics = jax.device_get({**prep, **upd})
  return jax.device_get(state.params), metrics


def _arrays(run, multiple):
  rb, rew = _rollout()
  # Pretend the engine differs from the trainer: shift μ a little.
  return batch_lib.assemble(
    rb,
    rew,
    trainer_version=0,
    max_staleness=None,
    logprob_mode='full',
    row_multiple=multiple,
  )


def _close(a, b, rtol=2e-5, atol=2e-6):
  for x, y in zip(jax.tree.leaves(a[0]), jax.tree.leaves(b[0])):
    np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)
  keys = set(a[1]) & set(b[1])
  assert keys == set(a[1]) == set(b[1])
  for k in keys:
    np.testing.assert_allclose(
      a[1][k], b[1][k], rtol=1e-4, atol=1e-5, err_msg=k
    )


def _one_device_mesh():
  return sharding.make_mesh(devices=jax.devices()[:1])


@pytest.mark.parametrize(
  'preset', ['decoupled_seq_is_rs', 'bypass_ppo_clip_geo_rs', 'bypass_pg_is']
)
def test_padding_rows_change_nothing(preset):
  """8 real rows vs the same rows + 8 PAD rows (docs/math/rollout_contract.md §5
  regression)."""
  run = _run(preset)
  mesh = _one_device_mesh()
  plain = _arrays(run, 1)
  padded = _arrays(run, 16)
  assert padded.tokens.shape[0] == 16
  # Padding rows carry every per-token field, rollout_logp included.
  assert all(x.shape[0] == 16 for x in jax.tree.leaves(padded))
  assert not padded.response_mask[B:].any()
  a = _step(run, mesh, plain)
  b = _step(run, mesh, padded)
  for k in ('batch/valid_rows', 'batch/valid_tokens'):
    assert a[1][k] == b[1][k]
  _close(a, b)


@pytest.mark.parametrize(
  'preset', ['decoupled_token_is', 'bypass_ppo_clip_geo_rs']
)
def test_micro_batches_use_global_normalisers(preset):
  """1 micro-batch vs 4: the same update (token-mean over the mini-batch,
  not a mean of micro-batch means)."""
  mesh = _one_device_mesh()
  arrays = _arrays(_run(preset), 1)
  a = _step(_run(preset), mesh, arrays)
  b = _step(_run(preset, micro_batches=4), mesh, arrays)
  # Per-call averages (clip fractions; in bypass mode the correction's
  # mean statistics, computed per micro-batch as in verl) legitimately
  # differ; losses, gradients, counts and extremes must not.
  for m in (a[1], b[1]):
    for k in list(m):
      per_call = k.startswith('actor/pg_clip') or k == 'actor/ppo_kl'
      per_call |= k.startswith('rollout_corr/') and not k.endswith(
        ('max', 'min')
      )
      if per_call:
        m.pop(k)
  _close(a, b)


def test_sharded_equals_single_device():
  run = _run('decoupled_geo_rs')
  arrays = _arrays(run, 8)
  a = _step(run, _one_device_mesh(), arrays)
  b = _step(
    run, sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=4)), arrays
  )
  _close(a, b, rtol=1e-4, atol=1e-5)


def test_no_gradient_through_old_or_rollout_logp():
  """Changing μ or π_old values changes the loss value only through the
  correction's (stop-gradient) weights: the update direction comes from
  logp alone. Checked by differentiating prepare's outputs."""
  run = _run('decoupled_token_is')
  mesh = _one_device_mesh()
  arrays = _arrays(run, 1)
  cfg = model_config(run)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  tx, schedule = make_optimizer(run.optim, 1e-3, 10)
  steps = Steps(run, graphdef, tx, schedule)
  with jax.set_mesh(mesh):
    dev = jax.tree.map(jnp.asarray, arrays)

    def total_old(p):
      _, arr, _ = steps._prepare(
        p, None, rewards.KLControllerState(jnp.zeros(())), None, dev
      )
      return jnp.sum(arr.old_logp) + jnp.sum(arr.corr_weights)

    g = jax.grad(total_old)(params)
  assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(g))
