"""Advantages, the KL controller and utilities against SkyRL's goldens
(`adv`, `kl_ctrl`, `util`), on valid positions at rtol = atol = 1e-6."""

from __future__ import annotations

import pytest

from jaxcorr.losses import advantages_scan as scan_lib
from jaxcorr.losses import masked
from jaxcorr.losses import rewards as rw
from tests.helpers import advantage_replay as ar
from tests.helpers import golden_data as gd
from tests.helpers.tolerance import assert_close

SKYRL_ESTIMATORS = {'reinforce++': 'reinforce_plus_plus'}


@pytest.mark.parametrize('case', gd.case_params('skyrl', group='adv'))
def test_skyrl_advantage(case):
  if case['id'] == 'adv/gae_g0.99_l0.95':
    pytest.skip(
      'D13: SkyRL recurses over the values left in the padding after a '
      'left-aligned response; jaxcorr skips padding. Asserted in '
      'test_d13_skyrl_gae_reads_left_padding'
    )
  gs = gd.load('skyrl')
  kw, out = gs.kwargs(case), gs.outputs(case)
  m = kw['response_mask'] > 0
  name = SKYRL_ESTIMATORS.get(kw['adv_estimator'], kw['adv_estimator'])
  a, r = ar.run_estimator(
    name,
    kw['token_level_rewards'],
    m,
    ar.group_ids(kw['index']),
    values=kw.get('values'),
    gamma=kw.get('gamma', 1.0),
    lam=kw.get('lambd', 1.0),
    norm_adv_by_std=kw.get('grpo_norm_by_std', True),
  )
  assert_close(a, out['advantages'], mask=m, what='advantages')
  assert_close(r, out['returns'], mask=m, what='returns')


@pytest.mark.parametrize('case', gd.case_params('skyrl', group='kl_ctrl'))
def test_skyrl_kl_controller(case):
  gs = gd.load('skyrl')
  kw = gs.kwargs(case)
  cfg = rw.KLControlConfig(
    type='adaptive',
    kl_coef=kw['init_kl_coef'],
    target_kl=kw['target'],
    horizon=kw['horizon'],
  )
  state, got = rw.init_kl_controller(cfg), []
  for current, n_steps in kw['updates']:
    state = rw.update_kl_controller(state, current, n_steps, cfg)
    got.append(float(state.coef))
  assert_close(got, gs.outputs(case)['values_after_each_update'])


@pytest.mark.parametrize('case', gd.case_params('skyrl', group='util'))
def test_skyrl_util(case):
  gs = gd.load('skyrl')
  kw, out = gs.kwargs(case), gs.outputs(case)['out']
  if case['id'] == 'util/safe_exp_delta':
    assert_close(masked.exp_clamped(kw['delta']), out)
    return
  m = kw['mask'] > 0
  if case['id'] == 'util/masked_whiten':
    assert_close(scan_lib.whiten(kw['values'], m), out, mask=m)
  else:
    assert_close(scan_lib.masked_var(kw['values'], m), out)
