"""The jitted step: padding rows, micro-batching and sharding change nothing.

One synthetic rollout batch (random tokens, a simulated engine mismatch in
`rollout_logp`) goes through `Steps.prepare` + `Steps.update` under several
layouts; losses, metrics and updated params must agree. The step's loss
has no gradient through π_old or the rollout log-probs μ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr import sharding
from jaxcorr.losses import objective
from jaxcorr.train import batch as batch_lib
from jaxcorr.train import build
from jaxcorr.train import step as step_lib
from tests.helpers.model_testing import fresh_train_state
from tests.helpers.step_batches import one_device_mesh, step_arrays
from tests.helpers.tolerance import (
  TOL_LAYOUT,
  TOL_LAYOUT_METRICS,
  TOL_LAYOUT_SHARDED,
  assert_close,
)
from tests.helpers.trainer_config import pulse_config


def _run(preset: str, **train):
  overrides = {f'train__{k}': v for k, v in train.items()}
  return build.build(
    pulse_config(preset, train__shuffle_minibatches=False, **overrides)
  )


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


def _assert_same_step(a, b, params_tol=TOL_LAYOUT):
  """Two `(params, metrics)` results of `_step`: the same parameters within
  `params_tol`, the same metric keys and values within TOL_LAYOUT_METRICS."""
  for x, y in zip(jax.tree.leaves(a[0]), jax.tree.leaves(b[0])):
    assert_close(x, y, params_tol)
  keys = set(a[1]) & set(b[1])
  assert keys == set(a[1]) == set(b[1])
  for k in keys:
    assert_close(a[1][k], b[1][k], TOL_LAYOUT_METRICS, what=k)


@pytest.mark.parametrize(
  'preset', ['decoupled_seq_is_rs', 'bypass_ppo_clip_geo_rs', 'bypass_pg_is']
)
def test_padding_rows_change_nothing(preset):
  """8 real rows vs the same rows + 8 PAD rows (docs/math/rollout_contract.md §5
  regression)."""
  run = _run(preset)
  mesh = one_device_mesh()
  plain = step_arrays(run, 1)
  padded = step_arrays(run, 16)
  assert padded.tokens.shape[0] == 16
  # Padding rows carry every per-token field, rollout_logp included.
  assert all(x.shape[0] == 16 for x in jax.tree.leaves(padded))
  assert not padded.response_mask[8:].any()
  a = _step(run, mesh, plain)
  b = _step(run, mesh, padded)
  for k in ('batch/valid_rows', 'batch/valid_tokens'):
    assert a[1][k] == b[1][k]
  _assert_same_step(a, b)


@pytest.mark.parametrize(
  'preset', ['decoupled_token_is', 'bypass_ppo_clip_geo_rs']
)
def test_micro_batches_use_global_normalisers(preset):
  """1 micro-batch vs 4: the same update (token-mean over the mini-batch,
  not a mean of micro-batch means)."""
  mesh = one_device_mesh()
  arrays = step_arrays(_run(preset), 1)
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
  _assert_same_step(a, b)


def test_sharded_equals_single_device():
  run = _run('decoupled_geo_rs')
  arrays = step_arrays(run, 8)
  a = _step(run, one_device_mesh(), arrays)
  b = _step(
    run, sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=4)), arrays
  )
  _assert_same_step(a, b, TOL_LAYOUT_SHARDED)


@pytest.mark.parametrize(
  'preset',
  [
    # μ reaches the loss through the correction's weights and mask (made in
    # prepare) and through the rollout-KL term.
    'decoupled_token_is+rollout_kl',
    # μ is the ratio's anchor and the rollout-KL term's reference.
    'bypass_ppo_clip+rollout_kl',
  ],
)
def test_no_gradient_through_old_or_rollout_logp(preset):
  """π_old and μ are data: the update direction comes from logp alone.

  One step's actor loss, as a function of the params prepare computes π_old
  with, of the rollout log-probs μ it is given and of the params the update
  differentiates, has exactly zero gradient w.r.t. the first two (and the
  arrays prepare hands to the update carry none), while its gradient w.r.t.
  the update's params is not zero."""
  run = _run(preset)
  mesh = one_device_mesh()
  state, steps = fresh_train_state(run, mesh)
  with jax.set_mesh(mesh):
    batch = batch_lib.to_device(mesh, step_arrays(run, 1))

    def prepared(old_params, rollout_logp):
      return steps._prepare(
        old_params,
        None,
        state.kl_ctrl,
        None,
        batch.replace(rollout_logp=rollout_logp),
      )[1]

    def loss(old_params, rollout_logp, params):
      mic = prepared(old_params, rollout_logp)
      if run.decoupled:
        counts = objective.loss_normalizers(mic.response_mask & mic.corr_mask)
      else:  # bypass: unit normalisers, the step divides afterwards
        counts = (jnp.float32(1), jnp.float32(1))
      return step_lib._actor_loss(
        run, steps.graphdef, params, mic, counts, jax.random.key(0)
      )[0]

    def handed_on(old_params, rollout_logp):
      mic = prepared(old_params, rollout_logp)
      return jnp.sum(mic.old_logp) + jnp.sum(mic.corr_weights)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    g_old, g_mu, g_params = grads(
      state.params, batch.rollout_logp, state.params
    )
    if run.decoupled:
      g_handed = jax.jit(jax.grad(handed_on, argnums=(0, 1)))(
        state.params, batch.rollout_logp
      )
  assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(g_old))
  assert not np.any(np.asarray(g_mu))
  assert any(np.any(np.asarray(x)) for x in jax.tree.leaves(g_params))
  if run.decoupled:
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(g_handed))
