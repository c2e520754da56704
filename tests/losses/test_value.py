"""The value loss (jaxcorr/losses/value.py): the formula by hand, the ½ factor
and aggregation modes, JAX contracts, and its errors."""

import jax
import numpy as np
import pytest

from jaxcorr.losses import aggregate as agg_lib
from jaxcorr.losses import objective as obj
from jaxcorr.losses import objective_config as obj_cfg
from jaxcorr.losses import value as val
from tests.helpers import objective_batches as ob
from tests.helpers.tolerance import TOL_EQUIVALENT, TOL_REORDERED, assert_close


def test_value_loss_formula_by_hand():
  v = np.array([[1.0, 2.0, 3.0, 9.0]], np.float32)
  v_old = np.array([[1.2, 1.0, 3.1, 0.0]], np.float32)
  ret = np.array([[0.5, 2.5, 3.0, 0.0]], np.float32)
  mask = np.array([[True, True, True, False]])
  loss, met = val.value_loss(v, v_old, ret, mask, cliprange_value=0.5)
  # token 0: unclipped (0.5)²=0.25, clipped v̂=1.0 -> 0.25: 0.25 (no clip)
  # token 1: unclipped 0.25, v̂=1.5 -> 1.0: clipped wins
  # token 2: unclipped 0, v̂=3.0 -> 0: 0
  assert_close(loss, 0.5 * (0.25 + 1.0 + 0.0) / 3)
  assert_close(met['critic/vf_clipfrac'], 1 / 3)
  assert_close(met['critic/vpred_mean'], 2.0)
  g = jax.grad(lambda x: val.value_loss(x, v_old, ret, mask)[0])(v)
  # token 1's max branch is the clipped one, whose clip is active: grad 0.
  assert_close(g, [[(1.0 - 0.5) / 3, 0.0, 0.0, 0.0]])


def test_value_loss_half_factor_and_agg_modes():
  data = ob.batch(seed=15)
  v, v_old = data['logp'], data['old_logp']
  ret, mask = data['ref_logp'], data['mask']
  for mode in agg_lib.MODES:
    loss, _ = val.value_loss(v, v_old, ret, mask, agg=mode, cliprange_value=0.2)
    vc = np.clip(v, v_old - 0.2, v_old + 0.2)
    per = np.maximum((v - ret) ** 2, (vc - ret) ** 2)
    assert_close(
      2 * loss, ob.np_aggregate(per, mask, mode)
    )  # slime omits the ½


def test_value_loss_contracts():
  data = ob.batch(seed=16)
  v, v_old, ret, mask = (
    data['logp'],
    data['old_logp'],
    data['ref_logp'],
    data['mask'],
  )
  grads = jax.grad(
    lambda a, b: val.value_loss(v, a, b, mask, cliprange_value=0.05)[0],
    argnums=(0, 1),
  )(v_old, ret)
  assert not any(np.any(np.asarray(g)) for g in grads)
  junk = np.where(mask, 0, np.nan).astype(np.float32)

  def run(add):
    def f(x):
      return val.value_loss(x + add, v_old + add, ret + add, mask)

    return jax.value_and_grad(f, has_aux=True)(v)

  (l1, m1), g1 = run(np.zeros_like(junk))
  (l2, m2), g2 = run(junk)
  assert np.asarray(l1).tobytes() == np.asarray(l2).tobytes()
  assert np.asarray(g1).tobytes() == np.asarray(g2).tobytes()
  for k in m1:
    assert np.asarray(m1[k]).tobytes() == np.asarray(m2[k]).tobytes()
  empty = np.zeros_like(mask)
  for mode in agg_lib.MODES:
    val_, g = jax.value_and_grad(
      lambda x, mo=mode: val.value_loss(x, v_old, ret, empty, agg=mo)[0]
    )(v)
    assert float(val_) == 0.0 and not np.any(np.asarray(g))
  # Micro-batches with global counts reproduce the full batch.
  full = val.value_loss(v, v_old, ret, mask, agg='seq_mean_token_mean')[0]
  n_seq = mask.any(-1).sum()
  parts = sum(
    val.value_loss(
      v[s], v_old[s], ret[s], mask[s], agg='seq_mean_token_mean', num_seqs=n_seq
    )[0]
    for s in (slice(0, 4), slice(4, 8))
  )
  assert_close(parts, full, TOL_REORDERED)
  jit_loss = jax.jit(lambda *a: val.value_loss(*a)[0])(v, v_old, ret, mask)
  assert_close(jit_loss, val.value_loss(v, v_old, ret, mask)[0], TOL_EQUIVALENT)


@pytest.mark.parametrize('eps', [0, -0.1, True, None, 'x'])
def test_value_loss_bad_cliprange(eps):
  x = np.zeros((1, 2), np.float32)
  with pytest.raises(
    ValueError, match=r'cliprange_value.*allowed: a number > 0'
  ):
    val.value_loss(x, x, x, np.ones((1, 2), bool), cliprange_value=eps)


def test_value_loss_bad_agg_and_mask():
  x = np.zeros((1, 2), np.float32)
  with pytest.raises(ValueError, match=r"agg='mean'.*allowed"):
    val.value_loss(x, x, x, np.ones((1, 2), bool), agg='mean')
  with pytest.raises(ValueError, match='bool'):
    val.value_loss(x, x, x, np.ones((1, 2), np.float32))
  with pytest.raises(ValueError, match='shape mismatch'):
    val.value_loss(x, x[:, :1], x, np.ones((1, 2), bool))


def test_reinforce_reads_old_logp_for_its_metric_only():
  d = ob.batch(seed=17)
  lp = d.pop('logp')
  d.pop('old_logp')
  actor = obj_cfg.ActorLossConfig(policy_loss='reinforce')
  loss, met = obj.actor_objective(actor, None, logp=lp, **d)
  assert 'actor/ppo_kl' not in met
  gpg, _ = obj.actor_objective(
    obj_cfg.ActorLossConfig(policy_loss='gpg'), None, logp=lp, **d
  )
  np.testing.assert_array_equal(loss, gpg)


def test_value_loss_accepts_numpy_scalars():
  x = np.array([[0.0, 1.0]], np.float32)
  mask = np.ones((1, 2), bool)
  a, _ = val.value_loss(x, x, x + 1, mask, cliprange_value=np.float32(0.2))
  b, _ = val.value_loss(x, x, x + 1, mask, cliprange_value=0.2)
  np.testing.assert_allclose(a, b, rtol=1e-7)
  assert_close(a, 0.5)
