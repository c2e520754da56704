"""Advantages, KL in reward and the KL controller against verl's goldens
(`advantage`, `kl_in_reward`, `kl_controller`).

Values are compared on valid positions at rtol = atol = 1e-6 (float32), and
jaxcorr's outputs must be exactly 0 outside the mask (D13). A case is
skipped only when its function is outside the spec (verl's optimal-token
baselines); documented divergences have their own tests in
tests/conformance/divergences/test_advantages.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxcorr.losses import advantages_scan as scan_lib
from jaxcorr.losses import kl as kl_lib
from jaxcorr.losses import rewards as rw
from tests.helpers import advantage_replay as ar
from tests.helpers import golden_data as gd
from tests.helpers.tolerance import assert_close

VERL_ALIASES = {'grpo_vectorized': 'grpo', 'rloo_vectorized': 'rloo'}
VERL_OUT_OF_SCOPE = {
  'optimal_token_baseline': (
    'verl optimal_token_baseline is not an estimator of '
    'docs/math/advantages.md §4 (it needs the model-side sum_pi_squared per '
    'token)'
  ),
  'tir_optimal_token_baseline': (
    'verl tir_optimal_token_baseline is not an estimator of '
    'docs/math/advantages.md §4 (it needs the model-side sum_pi_squared per '
    'token)'
  ),
}


@pytest.mark.parametrize('case', gd.case_params('verl', group='advantage'))
def test_verl_advantage(case):
  name = case['id'].split('/')[1]
  if name in VERL_OUT_OF_SCOPE:
    pytest.skip(VERL_OUT_OF_SCOPE[name])
  gs = gd.load('verl')
  kw, out = gs.kwargs(case), gs.outputs(case)
  _, m, ids = ar.verl_main()
  algo = kw.get('config') or {}
  norm = kw.get(
    'norm_adv_by_std_in_grpo', algo.get('norm_adv_by_std_in_grpo', True)
  )
  if name == 'gdpo':
    # Not a spec estimator: with the single reward dimension stored here,
    # verl's GDPO is whiten(grpo) over the batch; rebuilt from jaxcorr's
    # public grpo and whiten.
    a, _ = ar.run_estimator(
      'grpo', kw['token_level_rewards'], m, ids, norm_adv_by_std=norm
    )
    a = scan_lib.whiten(a, m)
    assert_close(a, out['advantages'], mask=m)
    assert_close(a, out['returns'], mask=m)
    return
  a, r = ar.run_estimator(
    VERL_ALIASES.get(name, name),
    kw['token_level_rewards'],
    m,
    ids,
    values=kw.get('values'),
    gamma=kw.get('gamma', algo.get('gamma', 1.0)),
    lam=kw.get('lam', algo.get('lam', 1.0)),
    norm_adv_by_std=norm,
    reward_baselines=kw.get('reward_baselines'),
  )
  assert_close(a, out['advantages'], mask=m, what='advantages')
  assert_close(r, out['returns'], mask=m, what='returns')


@pytest.mark.parametrize('case', gd.case_params('verl', group='kl_in_reward'))
def test_verl_kl_in_reward(case):
  gs = gd.load('verl')
  kw, out = gs.kwargs(case), gs.outputs(case)
  batch = kw['data.batch']
  m = batch['response_mask'] > 0
  cfg = rw.KLControlConfig(**ar.config_fields(kw['kl_ctrl']))
  state = rw.init_kl_controller(cfg)
  rewards, kl, metrics = rw.apply_kl_penalty(
    batch['token_level_scores'],
    batch['old_log_probs'],
    batch['ref_log_prob'],
    m,
    state.coef,
    estimator=kw['kl_penalty'],
  )
  assert_close(rewards, out['token_level_rewards'], mask=m)
  ar.zero_outside(rewards, m)
  expected_kl = kl_lib.kl_penalty(
    batch['old_log_probs'], batch['ref_log_prob'], kw['kl_penalty'], mask=m
  )
  np.testing.assert_array_equal(np.asarray(kl), np.asarray(expected_kl))
  assert set(metrics) == set(case['metrics'])
  for key, value in case['metrics'].items():
    assert_close(metrics[key], value, what=key)
  new = rw.update_kl_controller(
    state, metrics[rw.KL_METRIC], kw['n_steps(batch_size)'], cfg
  )
  assert_close(
    new.coef, out['kl_coef_after_update'], what='kl_coef_after_update'
  )


@pytest.mark.parametrize('case', gd.case_params('verl', group='kl_controller'))
def test_verl_kl_controller_trajectory(case):
  kw = gd.load('verl').kwargs(case)
  cfg = rw.KLControlConfig(
    type='adaptive',
    kl_coef=kw['init_kl_coef'],
    target_kl=kw['target_kl'],
    horizon=kw['horizon'],
  )
  state, got = rw.init_kl_controller(cfg), []
  for current in kw['current_kl_sequence']:
    state = rw.update_kl_controller(state, current, kw['n_steps'], cfg)
    got.append(float(state.coef))
  assert_close(got, gd.load('verl').outputs(case)['kl_coef_trajectory'])
