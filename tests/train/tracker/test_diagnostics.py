"""`train.metrics_every`: a light step (no heavy diagnostics) makes the same
update as a full one and logs a subset of its metrics."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxcorr.train import batch as batch_lib
from jaxcorr.train import build
from jaxcorr.train.step import needs_entropy
from jaxcorr.train.tracker import diagnostics
from tests.helpers.model_testing import fresh_train_state
from tests.helpers.step_batches import one_device_mesh, step_arrays
from tests.helpers.tolerance import TOL_GOLDEN, assert_close
from tests.helpers.trainer_config import pulse_config


def _step(run, arrays, light):
  mesh = one_device_mesh()
  state, steps = fresh_train_state(run, mesh, sharded=True)
  with jax.set_mesh(mesh):
    dev = batch_lib.to_device(mesh, arrays)
    _, prepared, prep = steps.prepare(
      state.params, None, state.kl_ctrl, None, dev, light=light
    )
    state, upd = steps.update(state, prepared, light=light)
  return jax.device_get(state.params), jax.device_get({**prep, **upd})


def test_light_step_makes_the_same_update():
  run = build.build(
    pulse_config(
      'decoupled_geo_rs_token_tis',
      train__shuffle_minibatches=False,
      train__metrics_every=10,
    )
  )
  arrays = step_arrays(run, 8)
  full_params, full = _step(run, arrays, light=False)
  light_params, light = _step(run, arrays, light=True)
  for x, y in zip(jax.tree.leaves(full_params), jax.tree.leaves(light_params)):
    assert_close(y, x, TOL_GOLDEN, what='params')
  assert set(light) < set(full)
  assert not any(diagnostics.is_heavy(k) for k in light)
  assert any(k.startswith('rollout_corr/') for k in full)
  for k, v in light.items():
    assert_close(v, full[k], TOL_GOLDEN, what=k)
  assert np.isfinite(light['actor/loss'])


@pytest.mark.parametrize('coef', [0.0, 0.01])
def test_light_step_computes_the_entropy_only_for_the_loss(coef):
  """Without an entropy term the vocabulary entropy is a diagnostic: a light
  step skips it (no `actor/entropy`), a full step logs it; with the term
  both steps compute it, and agree."""
  run = build.build(
    pulse_config(
      'bypass_ppo_clip',
      train__shuffle_minibatches=False,
      train__metrics_every=10,
      actor__entropy_coeff=coef,
    )
  )
  assert needs_entropy(run, light=True) == (coef != 0)
  assert needs_entropy(run, light=False)
  arrays = step_arrays(run, 8)
  full_params, full = _step(run, arrays, light=False)
  light_params, light = _step(run, arrays, light=True)
  assert ('actor/entropy' in light) == (coef != 0)
  assert full['actor/entropy'] > 0
  if coef:
    assert_close(light['actor/entropy'], full['actor/entropy'], TOL_GOLDEN)
  for x, y in zip(jax.tree.leaves(full_params), jax.tree.leaves(light_params)):
    assert_close(y, x, TOL_GOLDEN, what='params')


def test_full_steps():
  assert [diagnostics.full_step(s, 3) for s in range(5)] == [
    True,
    False,
    False,
    True,
    False,
  ]
