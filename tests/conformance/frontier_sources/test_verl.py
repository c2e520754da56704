"""verl's current DPPO, DRO and token-sum against `golden/frontier/verl_frontier`.

The cases (verl `182383bbb` #5397, `ddfbf4ea0` #7245, `4730d46b1` #7197; see
`tests/golden/frontier/verl_frontier/index.json`) replay one call each of
`compute_policy_loss_dppo_tv/_kl`, `compute_policy_loss_dro` and `agg_loss`.
verl's `ActorConfig` fields map to the registry knobs one to one
(`clip_ratio_low/high/c`, `policy_loss.dro_beta`); the DPPO ratio cap is
`clip_ratio_c`, which is 3.0 at verl's defaults although the code's fallback
(`config.get('clip_ratio_c', 20.0)`) suggests 20 (D18, docs/correction.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.losses import aggregate as agg_lib
from jaxcorr.losses import policy
from tests.helpers import golden_data as gd

FW = 'frontier/verl_frontier'
RTOL = ATOL = 1e-6


def _gs():
  return gd.load(FW)


def _abs_scale(per_abs, mask, mode):
  return float(agg_lib.aggregate(per_abs, mask, mode))


@pytest.mark.parametrize('case', gd.case_params(FW, prefix='pl/'))
def test_policy_loss(case):
  gs = _gs()
  kw = gs.kwargs(case)
  cfg = kw['config']
  name = case['group']
  knobs = {
    'clip_ratio_low': cfg['clip_ratio_low'],
    'clip_ratio_high': cfg['clip_ratio_high'],
    'clip_ratio_c': cfg['clip_ratio_c'],
  }
  if name == 'dro':
    knobs['dro_beta'] = cfg['policy_loss']['dro_beta']
  mask = kw['response_mask'].astype(bool)
  w = kw.get('rollout_is_weights')
  args = dict(
    old_logp=jnp.asarray(kw['old_log_prob']),
    advantages=jnp.asarray(kw['advantages']),
    mask=jnp.asarray(mask),
    is_weights=None if w is None else jnp.asarray(w),
    agg=kw['loss_agg_mode'],
  )
  err = gs.error(case)
  if err is not None:
    with pytest.raises(ValueError, match='dro_beta'):
      policy.policy_loss(
        name, jnp.asarray(kw['log_prob']), **args,
        knobs=policy.check_knobs(knobs),
      )  # fmt: skip
    return

  def fn(logp):
    return policy.policy_loss(
      name, logp, **args, knobs=policy.check_knobs(knobs)
    )

  (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(
    jnp.asarray(kw['log_prob'])
  )
  out = gs.outputs(case)
  np.testing.assert_allclose(loss, out['pg_loss'], rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(
    np.asarray(grad)[mask], out['grad_log_prob'][mask], rtol=RTOL, atol=ATOL
  )
  for key, want in gs.metrics(case).items():
    np.testing.assert_allclose(metrics[key], want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('case', gd.case_params(FW, prefix='agg/'))
def test_token_sum_and_mean_over_dp_shards(case):
  """verl scales the local sum by `dp_size` (token-sum) and divides by the
  global `batch_num_tokens`, so that the dp-average of the local losses is
  the global aggregate. jaxcorr aggregates the global batch directly: on dp
  identical shards its value is verl's local one, and so is its gradient
  with respect to one shard."""
  gs = _gs()
  kw = gs.kwargs(case)
  dp = kw.get('dp_size', 1)
  mat = jnp.asarray(kw['loss_mat'])
  mask = jnp.asarray(kw['loss_mask'].astype(bool))
  mode = kw['loss_agg_mode']
  num_tokens = kw.get('batch_num_tokens')

  def fn(m):
    tiled = jnp.concatenate([m] * dp, axis=0)
    loss = agg_lib.aggregate(
      tiled, jnp.concatenate([mask] * dp, 0), mode, num_tokens=num_tokens
    )
    return loss

  # verl's per-rank gradient is dp times the global loss's gradient on that
  # shard (DDP then averages it over the dp ranks, dividing by dp again).
  def one_copy(m):
    others = [jax.lax.stop_gradient(m)] * (dp - 1)
    tiled = jnp.concatenate([m, *others], axis=0)
    return agg_lib.aggregate(
      tiled, jnp.concatenate([mask] * dp, 0), mode, num_tokens=num_tokens
    )

  out = gs.outputs(case)
  np.testing.assert_allclose(fn(mat), out['loss'], rtol=RTOL, atol=ATOL)
  grad = jax.grad(one_copy)(mat) * dp
  np.testing.assert_allclose(
    np.asarray(grad)[np.asarray(mask)],
    out['grad_loss_mat'][np.asarray(mask)],
    rtol=RTOL,
    atol=ATOL,
  )


def test_d18_dppo_cap_is_clip_ratio_c_three_not_twenty():
  """verl reads `config.get('clip_ratio_c', 20.0)`, but ActorConfig always
  has the field (3.0), so the DPPO cap is 3 unless set; jaxcorr's default
  agrees. A token with ρ = 10 and A > 0 inside the TV band is weighted by
  3 (by 20 only when `clip_ratio_c=20` is set)."""
  logp = jnp.log(jnp.asarray([[0.1, 0.5]]))
  old = logp - jnp.log(10.0)  # ρ = 10 on both tokens
  adv = jnp.asarray([[1.0, 1.0]])
  mask = jnp.asarray([[True, False]])

  def grad(**knobs):
    return jax.grad(
      lambda lp: policy.policy_loss(
        'dppo_tv', lp, old, adv, mask, agg='token_sum',
        knobs=policy.check_knobs(dict(dppo_delta_high=1.0, **knobs)),
      )[0]
    )(logp)[0, 0]  # fmt: skip

  np.testing.assert_allclose(grad(), -3.0, rtol=1e-6)
  np.testing.assert_allclose(grad(clip_ratio_c=20.0), -10.0, rtol=1e-6)
  np.testing.assert_allclose(grad(dppo_ratio_cap=20.0), -10.0, rtol=1e-6)
