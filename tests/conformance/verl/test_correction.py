"""`rollout_correction` against verl's goldens: `preset` (correction
parts), `is_grid`, `rs_grid`, `is_rs_combo`, `offpolicy_metrics`,
`edge_all_rejected` (correction parts), `errors`, `legacy`. Expectations
per case: tests/helpers/correction_replay.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import correction_golden_map as gm
from tests.helpers import correction_replay as cr

NEW_KEYS = {
  'nonfinite_rollout_logp_count',
  'nonfinite_train_logp_count',
  'nonfinite_seq_fraction',
  'rejected_token_fraction',
  'rejected_seq_fraction',
  'rollout_is_seq_eff_sample_size',
  # self-normalised χ² (>= 0), next to verl's plug-in chi2_token/chi2_seq
  'chi2_token_sn',
  'chi2_seq_sn',
}
OFFPOLICY_KEYS = {
  'training_log_ppl',
  'training_ppl',
  'rollout_log_ppl',
  'rollout_ppl',
  'kl',
  'k3_kl',
  'log_ppl_diff',
  'log_ppl_abs_diff',
  'log_ppl_diff_max',
  'log_ppl_diff_min',
  'ppl_ratio',
  'chi2_token',
  'chi2_seq',
}
# The legacy helper (9b718e1a7) computed its IS summary statistics (mean, max,
# std, ESS, seq_*) on the weights *before* truncation and its RS statistics
# under legacy names; these keys keep the meaning they have today.
LEGACY_SHARED = OFFPOLICY_KEYS | {
  'rollout_is_min',
  'rollout_is_ratio_fraction_high',
  'rollout_is_ratio_fraction_low',
  'rollout_is_seq_fraction_high',
  'rollout_is_seq_fraction_low',
  'rollout_rs_masked_fraction',
  'rollout_rs_seq_masked_fraction',
  'rollout_is_veto_fraction',
  'rollout_is_catastrophic_token_fraction',
}


def _check_verl(gs, case: dict, kind: str) -> str:
  call = gm.verl_call(gs, case, verl_k1=kind == 'D1')
  out = cr.run_correction(call)
  outs = gs.outputs(case)
  ref_metrics = gs.metrics(case) or {}
  legacy = case['group'] == 'legacy'
  ref_mask = outs.get('modified_response_mask', outs.get('response_mask'))
  if ref_mask is not None:
    cr.check_mask(out.mask, ref_mask)
  ref_w = outs.get('rollout_is_weights')
  om = np.asarray(out.mask)
  if ref_w is not None:
    cr.check_weights(out, ref_w, om)
  elif 'rollout_is_weights' in outs:  # IS off: weights are the kept mask
    np.testing.assert_array_equal(
      np.asarray(out.weights), om.astype(np.float32)
    )
  ours = {k[len(cr.PREFIX) :] for k in out.metrics}
  refs = {k.removeprefix(cr.PREFIX): v for k, v in ref_metrics.items()}
  if legacy:
    for name, v in refs.items():
      if name not in LEGACY_SHARED:
        continue
      if name in ours:
        cr.metric_close(name, out.metrics[cr.PREFIX + name], v)
      else:  # legacy logs the veto metrics as 0 when the veto is off
        assert name.startswith('rollout_is_') and v == 0, (name, v)
    return 'legacy: masks, weights, shared-semantics metrics'
  missing = set(refs) - ours
  assert not missing, f'reference metrics missing in jaxcorr: {missing}'
  for name, v in refs.items():
    cr.metric_close(name, out.metrics[cr.PREFIX + name], v)
  prefixed = next(iter(ref_metrics), cr.PREFIX).startswith(cr.PREFIX)
  if prefixed and ref_metrics:  # a full metric dict: same key set + new ones
    extra = ours - set(refs)
    assert extra <= NEW_KEYS, f'unexpected jaxcorr metrics: {extra - NEW_KEYS}'
  return kind


def _check_verl_diverges(gs, case: dict, why: str, raises: bool) -> str:
  if raises:
    with pytest.raises(ValueError):
      cr.run_correction(gm.verl_call(gs, case))
    return why
  out = cr.run_correction(gm.verl_call(gs, case))
  for name, v in out.metrics.items():
    assert np.isfinite(np.asarray(v)), name
  assert np.isfinite(np.asarray(out.weights)).all()
  if why == 'D3':  # ZeroDivisionError in verl's ESS; everything out of band
    assert cr.metric(out, 'rollout_is_eff_sample_size') == 0.0
  if why.startswith('D2'):  # nothing valid: nothing kept, every metric 0
    assert not np.asarray(out.mask).any()
    assert all(float(v) == 0.0 for v in out.metrics.values())
  if why.startswith('geometric'):  # verl has no geometric IS; slime's value
    assert np.asarray(out.mask).any()
  return why


@pytest.mark.golden('verl')
@pytest.mark.parametrize('case_id', cr.case_ids('verl'))
def test_verl(case_id):
  gs = gm.load('verl')
  case = gs.case(case_id)
  kind, _ = cr.classify('verl', case)
  if kind == 'diverges':
    why, raises = cr.VERL_DIVERGES[case_id]
    _check_verl_diverges(gs, case, why, raises)
  elif kind == 'raises':
    with pytest.raises(ValueError):
      cr.run_correction(gm.verl_call(gs, case))
  else:
    _check_verl(gs, case, kind)
