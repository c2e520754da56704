"""The objective's JAX contracts: zero gradient through constants, padding
invisible bit for bit, jit = eager, 8 devices = 1, all-masked batches give
an exact zero, extreme log-ratios stay finite."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.losses import aggregate as agg_lib
from jaxcorr.losses import correction as corr_lib
from jaxcorr.losses import objective as obj
from jaxcorr.losses import objective_config as obj_cfg
from tests.helpers import objective_batches as ob
from tests.helpers.tolerance import (
  TOL_REORDERED,
  TOL_REORDERED_GRAD,
  TOL_REORDERED_METRICS,
  assert_close,
)


def _contract_setups():
  return {
    'none': (obj_cfg.ActorLossConfig(**ob.ALL_TERMS), None),
    'decoupled': (obj_cfg.ActorLossConfig(**ob.ALL_TERMS), ob.RS_DECOUPLED),
    'bypass': (
      obj_cfg.ActorLossConfig(policy_loss='reinforce', **ob.ALL_TERMS),
      ob.RS_BYPASS,
    ),
  }


@pytest.mark.parametrize('setup', ['none', 'decoupled', 'bypass'])
def test_gradient_of_constants_is_exactly_zero(setup):
  actor, cc = _contract_setups()[setup]
  data = ob.batch(seed=5)
  names = ['old_logp', 'rollout_logp', 'ref_logp', 'advantages']
  if setup == 'bypass':
    names.remove('old_logp')

  def f(*consts):
    d = dict(data, **dict(zip(names, consts)))
    d.pop('logp')
    if setup == 'bypass':
      d.pop('old_logp')
    elif setup == 'decoupled':  # the correction is part of the pipeline
      d['correction'] = corr_lib.rollout_correction(
        d['old_logp'], d['rollout_logp'], d['mask'], cc
      )
    return obj.actor_objective(actor, cc, logp=data['logp'], **d)[0]

  grads = jax.grad(f, argnums=tuple(range(len(names))))(
    *(jnp.asarray(data[n]) for n in names)
  )
  for n, g in zip(names, grads):
    assert not np.any(np.asarray(g)), n
  # ... while logp and entropy do carry gradient.
  _, _, g = ob.run_objective(actor, cc, data)
  assert np.any(g)


@pytest.mark.parametrize('setup', ['none', 'decoupled', 'bypass'])
def test_nan_in_padding_is_bitwise_invariant(setup):
  actor, cc = _contract_setups()[setup]
  clean = ob.batch(seed=6)
  dirty = dict(clean)
  pad = ~clean['mask']
  junk = np.where(np.arange(pad.size).reshape(pad.shape) % 3, np.nan, np.inf)
  for k in ('logp', 'old_logp', 'rollout_logp', 'ref_logp', 'advantages'):
    dirty[k] = np.where(pad, junk, clean[k]).astype(np.float32)
  dirty['entropy'] = np.where(pad, -np.inf, clean['entropy']).astype(np.float32)

  def run(d):
    d = dict(d)
    lp, ent = d.pop('logp'), d.pop('entropy')
    if cc is not None and cc.mode == 'bypass':
      d.pop('old_logp')
    elif cc is not None:
      d['correction'] = corr_lib.rollout_correction(
        d['old_logp'], d['rollout_logp'], d['mask'], cc
      )

    def f(x, e):
      return obj.actor_objective(actor, cc, logp=x, entropy=e, **d)

    return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(lp, ent)

  (v1, m1), g1 = run(clean)
  (v2, m2), g2 = run(dirty)
  assert np.asarray(v1).tobytes() == np.asarray(v2).tobytes()
  for a, b in zip(g1, g2):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  assert m1.keys() == m2.keys()
  for k in m1:
    assert np.asarray(m1[k]).tobytes() == np.asarray(m2[k]).tobytes(), k


def _jitted(actor, cc):
  """value_and_grad of the whole step; decoupled runs its correction first."""

  def f(data):
    d = dict(data)
    lp = d.pop('logp')
    if cc is not None and cc.mode == 'bypass':
      d.pop('old_logp')
    elif cc is not None and 'correction' not in d:
      d['correction'] = corr_lib.rollout_correction(
        d['old_logp'], d['rollout_logp'], d['mask'], cc
      )

    def loss(x):
      return obj.actor_objective(actor, cc, logp=x, **d)

    return jax.value_and_grad(loss, has_aux=True)(lp)

  return f


@pytest.mark.parametrize('setup', ['decoupled', 'bypass'])
def test_jit_equals_eager(setup):
  actor, cc = _contract_setups()[setup]
  data = ob.batch(seed=7)
  if setup == 'decoupled':
    data['correction'] = corr_lib.rollout_correction(
      data['old_logp'], data['rollout_logp'], data['mask'], cc
    )
  f = _jitted(actor, cc)
  (v0, m0), g0 = f(data)
  (v1, m1), g1 = jax.jit(f)(data)
  assert_close(v1, v0, TOL_REORDERED)
  assert_close(g1, g0, TOL_REORDERED_GRAD)
  assert m0.keys() == m1.keys()
  for k in m0:
    assert_close(m1[k], m0[k], TOL_REORDERED)


@pytest.mark.parametrize('setup', ['decoupled', 'bypass'])
def test_sharded_over_8_devices_equals_single_device(setup):
  devices = jax.devices()
  assert len(devices) == 8
  actor, cc = _contract_setups()[setup]
  data = ob.batch(seed=8)  # one row per device; correction inside the jit
  mesh = jax.sharding.Mesh(np.array(devices), ('data',))
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def put(x):
    x = jnp.asarray(x)
    return jax.device_put(x, spec if x.ndim == 2 else rep)

  f = jax.jit(_jitted(actor, cc))
  (v0, m0), g0 = f(jax.device_put(data, devices[0]))
  sharded = jax.tree.map(put, data)
  assert len(sharded['logp'].sharding.device_set) == 8
  (v1, m1), g1 = f(sharded)
  assert_close(v1, v0, TOL_REORDERED)
  assert_close(g1, g0, TOL_REORDERED_GRAD)
  for k in m0:
    assert_close(m1[k], m0[k], TOL_REORDERED_METRICS)


@pytest.mark.parametrize('setup', ['none', 'decoupled', 'bypass'])
def test_all_masked_is_exact_zero(setup):
  actor, cc = _contract_setups()[setup]
  data = ob.batch(seed=9)
  data['mask'] = np.zeros_like(data['mask'])
  for agg in agg_lib.MODES:
    a = dataclasses.replace(actor, agg=agg)
    v, met, g = ob.run_objective(a, cc, data)
    assert float(v) == 0.0 and not np.any(g), agg
    assert all(np.isfinite(np.asarray(x)) for x in met.values())


def test_extreme_log_ratios_are_finite():
  data = ob.batch(seed=10)
  data['logp'] = data['old_logp'] + np.float32(30.0)
  data['logp'][1, :4] = data['old_logp'][1, :4] - 30.0
  for setup in ('decoupled', 'bypass'):
    actor, cc = _contract_setups()[setup]
    v, _, g = ob.run_objective(actor, cc, data)
    assert np.isfinite(np.asarray(v)) and np.all(np.isfinite(g))
