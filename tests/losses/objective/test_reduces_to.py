"""The objective reduces to known losses: decoupled presets with identical
log-probs are plain PPO, bypass equals decoupled when old = rollout, and
bypass IS weights apply to REINFORCE only."""

import dataclasses

import numpy as np
import pytest

from configs import presets
from jaxcorr.losses import correction as corr_lib
from jaxcorr.losses import objective_config as obj_cfg
from tests.helpers import objective_batches as ob
from tests.helpers.tolerance import (
  TOL_EQUIVALENT,
  TOL_EQUIVALENT_GRAD,
  assert_close,
)

DECOUPLED_PRESETS = [
  n
  for n in presets.PRESETS
  if presets.PRESETS[n].get('correction.mode') == 'decoupled'
]


@pytest.mark.parametrize(
  'preset', DECOUPLED_PRESETS, ids=lambda n: f'preset={n}'
)
def test_decoupled_identical_logps_is_plain_ppo(preset):
  """μ = π_old: weights 1, nothing rejected -> exactly the uncorrected loss."""
  data = ob.batch(seed=2)
  data['rollout_logp'] = data['old_logp']
  actor, cc = ob.preset(preset)
  # VCPO's step scale and baseline act outside the objective
  # (jaxcorr/train/loss_batch.py), with their own reduces-to tests
  # (tests/conformance/shaping/test_vcpo.py); here only its correction.
  actor = dataclasses.replace(
    actor, **ob.ALL_TERMS, ess_scaling=False, grad_baselining=False
  )
  v1, m1, g1 = ob.run_objective(actor, cc, data)
  v0, m0, g0 = ob.run_objective(actor, None, data)
  assert float(m1['actor/loss_token_count']) == data['mask'].sum()
  np.testing.assert_array_equal(v1, v0)
  np.testing.assert_array_equal(g1, g0)
  for k in m0:
    np.testing.assert_array_equal(m1[k], m0[k])


@pytest.mark.parametrize(
  'bypass,decoupled',
  [('bypass_ppo_clip', 'disabled'), ('bypass_ppo_clip', 'decoupled_token_is')],
)
def test_bypass_equals_decoupled_when_old_is_rollout(bypass, decoupled):
  data = ob.batch(seed=3)
  data['rollout_logp'] = data['old_logp']
  a_b, c_b = ob.preset(bypass + '+rollout_kl')
  a_d, c_d = ob.preset(decoupled + '+rollout_kl')
  if decoupled == 'decoupled_token_is':  # IS in bypass ppo_clip: metrics only
    c_b = dataclasses.replace(c_b, is_level='token')
  v_b, _, g_b = ob.run_objective(a_b, c_b, data)
  v_d, _, g_d = ob.run_objective(a_d, c_d, data)
  assert_close(v_b, v_d, TOL_EQUIVALENT)
  assert_close(g_b, g_d, TOL_EQUIVALENT_GRAD)


def test_bypass_weights_only_for_reinforce():
  """ppo_clip: IS weights are metrics only; reinforce: they scale pg."""
  data = ob.batch(seed=4)
  vanilla = obj_cfg.ActorLossConfig()
  no_is = corr_lib.CorrectionConfig(mode='bypass')
  with_is = dataclasses.replace(no_is, is_level='token')
  v0, _, _ = ob.run_objective(vanilla, no_is, data)
  v1, m1, _ = ob.run_objective(vanilla, with_is, data)
  np.testing.assert_array_equal(v0, v1)
  assert 'rollout_corr/rollout_is_mean' in m1
  reinforce = obj_cfg.ActorLossConfig(policy_loss='reinforce')
  pg = dict(mode='bypass', bypass_loss='reinforce')
  r0, _, _ = ob.run_objective(reinforce, corr_lib.CorrectionConfig(**pg), data)
  r1, _, _ = ob.run_objective(
    reinforce, corr_lib.CorrectionConfig(is_level='token', **pg), data
  )
  assert abs(float(r0) - float(r1)) > 1e-4
  # With no IS, bypass reinforce is REINFORCE (= gpg) on the same mask.
  gpg, _, _ = ob.run_objective(
    obj_cfg.ActorLossConfig(policy_loss='gpg'), None, data
  )
  assert_close(r0, gpg)
