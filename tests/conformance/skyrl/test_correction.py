"""`rollout_correction` against SkyRL's goldens: `opc`, `opc_part`,
`opc_apply`. Expectations per case: tests/helpers/correction_replay.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import correction_golden_map as gm
from tests.helpers import correction_replay as cr
from tests.helpers.tolerance import assert_close

# SkyRL metric → jaxcorr metric with the same meaning (single-feature cases).
# "over_high" means ratio > high, i.e. the k1 statistic below its lower bound.
SKYRL_METRICS = {
  'tis_token_clip_high_ratio': 'rollout_is_ratio_fraction_high',
  'tis_seq_clip_high_ratio': 'rollout_is_ratio_fraction_high',
  'geo_sequence_mask_masked_ratio': 'rollout_rs_seq_mean_k1_seq_masked_fraction',
  'geo_sequence_mask_over_high_ratio': 'rollout_rs_seq_mean_k1_seq_fraction_low',
  'geo_sequence_mask_under_low_ratio': 'rollout_rs_seq_mean_k1_seq_fraction_high',
  'product_sequence_mask_masked_ratio': 'rollout_rs_seq_sum_k1_seq_masked_fraction',
  'product_sequence_mask_over_high_ratio': 'rollout_rs_seq_sum_k1_seq_fraction_low',
  'product_sequence_mask_under_low_ratio': 'rollout_rs_seq_sum_k1_seq_fraction_high',
  'outlier_seq_over_high_ratio': 'rollout_is_veto_high_fraction',
  'outlier_seq_under_low_ratio': 'rollout_is_veto_fraction',
  'outlier_seq_masked_ratio': 'rejected_seq_fraction',
  'token_mask_ratio': 'rollout_rs_token_k1_masked_fraction',
}
# SkyRL's is_ratio_{mean,std,max,min} pool the ratio over all B·T positions
# with masked ones as 0 (is_ratio_min = 0.0): no jaxcorr counterpart.
SKYRL_UNMAPPED = {
  'is_ratio_mean',
  'is_ratio_std',
  'is_ratio_max',
  'is_ratio_min',
}
# slime metrics that are per-sequence values broadcast over tokens; slime
# reduces them with the mean of per-sample means, which is jaxcorr's vmean.


def _skyrl_metrics(out, met: dict, cfg: dict, only=None) -> None:
  for name, v in met.items():
    if name in SKYRL_UNMAPPED or (only is not None and name not in only):
      continue
    ours = SKYRL_METRICS[name]
    if name == 'outlier_seq_masked_ratio':
      assert 'rs' not in cfg and 'is_level' not in cfg, 'veto must be alone'
    if cr.PREFIX + ours in out.metrics:
      cr.metric_close(name, out.metrics[cr.PREFIX + ours], v)
    else:  # SkyRL logs the side that is off as 0
      assert v == 0.0, (name, v)


def _check_skyrl(gs, case: dict, kind: str) -> str:
  call = gm.skyrl_call(gs, case)
  outs = gs.outputs(case)
  if kind == 'diverges':  # D8: SkyRL silently skips; jaxcorr raises
    with pytest.raises(ValueError, match='rollout_logp'):
      cr.run_correction(call)
    np.testing.assert_array_equal(outs['loss_mask'] > 0, call.mask)
    return 'D8'
  out = cr.run_correction(call)
  om = np.asarray(out.mask)
  met = outs.get('metrics') or {}
  group = case['group']
  if kind == 'D17':
    # Agree: the token TIS weight (a token quantity) wherever both keep the
    # token, and the outlier (veto) statistics, which SkyRL computes first.
    ref_mask = outs['loss_mask'] > 0
    both = om & ref_mask
    assert both.any()
    if group == 'opc':
      cr.check_weights(out, outs['tis_ratio'], both)
    else:
      kw = gs.kwargs(case)
      assert_close(
        (kw['loss'] * np.asarray(out.weights))[both], outs['loss'][both]
      )
    _skyrl_metrics(out, met, call.cfg, only={'outlier_seq_over_high_ratio'})
    return 'D17'
  loss_mask = call.mask
  if group == 'opc':
    cr.check_mask(om, outs['loss_mask'], 'loss_mask')
    if outs['tis_ratio'] is None:
      assert 'is_level' not in call.cfg
    else:
      cr.check_weights(out, outs['tis_ratio'], om)
    _skyrl_metrics(out, met, call.cfg)
  elif group == 'opc_part':
    if 'tis_ratio' in outs:
      cr.check_weights(out, outs['tis_ratio'], om)
    for key in ('sequence_mask', 'outlier_mask', 'token_mask'):
      if key in outs:
        ref = np.broadcast_to(outs[key], om.shape) > 0
        cr.check_mask(om, ref & loss_mask, key)
    _skyrl_metrics(out, met, call.cfg)
  else:  # opc_apply: loss · tis_ratio, new loss_mask
    cr.check_mask(om, outs['loss_mask'], 'loss_mask')
    kw = gs.kwargs(case)
    assert_close((kw['loss'] * np.asarray(out.weights))[om], outs['loss'][om])
    _skyrl_metrics(out, met, call.cfg)
  return 'parity'


@pytest.mark.golden('skyrl')
@pytest.mark.parametrize('case_id', cr.case_ids('skyrl'))
def test_skyrl(case_id):
  gs = gm.load('skyrl')
  case = gs.case(case_id)
  _check_skyrl(gs, case, cr.classify('skyrl', case)[0])
