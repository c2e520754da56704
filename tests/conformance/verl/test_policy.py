"""Policy losses against verl's goldens.

Each parametrised case replays one recorded call of verl's policy loss
(marked `golden('verl')`, so it shows in the per-framework conformance
summary). verl's gspo, sapo and geo_mean ignore `loss_agg_mode` (D9): their
cases run with agg=None, and tests/conformance/divergences/test_policy.py
asserts jaxcorr's value with an explicit agg.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest

from jaxcorr.losses import aggregate as agg_lib
from jaxcorr.losses import policy
from tests.helpers import golden_data as gd
from tests.helpers import policy_replay as pr
from tests.helpers.tolerance import assert_close

# Cases: the `policy_loss` group (every registry loss × 5 loss_agg_modes ×
# with/without `is_weights_token_tis2`, plus `reinforce_direct/*`) and
# `policy_loss_global`. Excluded (not collected): every `bypass_mode` case
# (`ploss/bypass_mode/*`, `ploss_gbi/bypass_mode/*`). They run the rollout
# correction inside the loss and belong to the actor-objective tests. This
# includes `ploss/bypass_mode/bad_loss_type/*`, whose error is about
# `RolloutCorrectionConfig.loss_type='pg'` (a correction-config value), not a
# policy-loss name.


def _verl_selected(case):
  return 'bypass_mode' not in case['id']


VERL_CASES = [
  p
  for grp in ('policy_loss', 'policy_loss_global')
  for p in gd.case_params('verl', group=grp)
  if _verl_selected(p.values[0])
]


def _run_verl(a):
  def fn(lp):
    loss, met = policy.policy_loss(
      a['name'],
      lp,
      a['old'],
      a['adv'],
      a['mask'],
      is_weights=a['w'],
      agg=a['agg'],
      num_tokens=a['num_tokens'],
      num_seqs=a['num_seqs'],
      norm=a['norm'],
      clip_cov_pick=a['pick'],
      knobs=policy.check_knobs(a['knobs']),
    )
    return loss * a['factor'], met

  return pr.value_grad(fn, a['logp'])


# Metrics jaxcorr logs beyond verl's: cispo's ratio statistics are SkyRL's
# (compared with SkyRL's goldens in tests/conformance/skyrl/test_policy.py).
NOT_IN_VERL = {
  'cispo': {
    'actor/cispo_ratio_mean',
    'actor/cispo_ratio_clamped_mean',
    'actor/cispo_ratio_max',
    'actor/cispo_ratio_min',
  },
}


@pytest.mark.parametrize('case', VERL_CASES)
def test_verl_policy_loss(case):
  gs = gd.load('verl')
  a = pr.verl_call(case)
  err = gs.error(case)
  if err is not None:
    # ploss/dro/beta_none_error: dro without dro_beta, verl's own message.
    assert a['name'] == 'dro' and a['knobs']['dro_beta'] is None
    with pytest.raises(ValueError, match=re.escape(err['message'])):
      _run_verl(a)
    return
  (loss, metrics), grad = _run_verl(a)
  out = gs.outputs(case)
  want_metrics = gs.metrics(case)
  ell = pr.per_token(
    a['name'], a['logp'], a['old'], a['adv'], a['mask'], w=a['w'],
    clip_cov_pick=a['pick'], **a['knobs'],
  )  # fmt: skip
  mode = a['agg'] or policy.NATURAL_AGG[a['name']]
  abs_terms = a['factor'] * agg_lib.aggregate(
    jnp.abs(ell), a['mask'], mode, num_tokens=a['num_tokens'],
    num_seqs=a['num_seqs'], norm=a['norm'],
  )  # fmt: skip
  assert_close(loss, out['loss'], scale=abs_terms)
  assert_close(grad, out['grad_log_prob'], mask=a['mask'])
  extra = NOT_IN_VERL.get(a['name'], set())
  assert extra <= set(metrics)
  assert set(metrics) - extra == set(want_metrics)
  for k, v in want_metrics.items():
    assert_close(metrics[k], v, what=k)
