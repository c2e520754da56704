"""`rollout_correction` against slime's goldens: `mis`, `tis`."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import correction_golden_map as gm
from tests.helpers import correction_replay as cr
from tests.helpers.tolerance import assert_close

# slime's per-token metrics (kl, k3_kl, chi2_token, tis_*, rs_mask_*, ...)
# reduced that way are per-sample means, not jaxcorr's token-pooled ones.
SLIME_SEQ_METRICS = {
  'training_log_ppl': 'training_log_ppl',
  'training_ppl': 'training_ppl',
  'rollout_log_ppl': 'rollout_log_ppl',
  'rollout_ppl': 'rollout_ppl',
  'log_ppl_diff': 'log_ppl_diff',
  'log_ppl_abs_diff': 'log_ppl_abs_diff',
  'ppl_ratio': 'ppl_ratio',
  'chi2_seq': 'chi2_seq',
  'rs_catastrophic_seq_fraction': 'rollout_is_veto_fraction',
}
# slime metrics that are one batch constant broadcast over tokens.
SLIME_CONST_METRICS = {'batch_norm_factor': 'rollout_is_batch_norm_factor'}


def _sample_mean(x: np.ndarray, mask: np.ndarray) -> float:
  """slime's reducer: the mean over samples of each sample's masked mean."""
  n = mask.sum(-1)
  return float(np.mean((x * mask).sum(-1) / np.maximum(n, 1)))


def _check_slime(gs, case: dict) -> str:
  call = gm.slime_call(gs, case)  # padding filled with NaN on purpose
  out = cr.run_correction(call)
  outs = gs.outputs(case)
  om, ow = np.asarray(out.mask), np.asarray(out.weights)
  if case['group'] == 'tis':
    kw = gs.kwargs(case)
    pg_in = gm.slime_rows(gs, kw['pg_loss'])
    pg_out = gm.slime_rows(gs, outs['pg_loss'])
    cr.check_mask(om, call.mask)  # masks are returned unchanged
    assert_close((pg_in * ow)[om], pg_out[om])
    return 'parity'
  ref_mask = gm.slime_rows(gs, outs['modified_masks']) > 0
  if call.cfg.get('is_mode') == 'mask':
    # slime zeroes the mask of out-of-band tokens and keeps the raw weight;
    # jaxcorr (verl) keeps the token and zeroes its weight
    # (docs/math/correction.md §4.3).
    cr.check_mask(om & (ow > 0), ref_mask)
  else:
    cr.check_mask(om, ref_mask)
  if outs['weights'] is not None:
    cr.check_weights(out, gm.slime_rows(gs, outs['weights']), ref_mask)
  else:
    assert 'is_level' not in call.cfg
  for key, ref in outs.items():
    name = key.removeprefix('metric_')
    if name in SLIME_SEQ_METRICS:
      per_token = gm.slime_rows(gs, ref)
      cr.metric_close(
        name,
        out.metrics[cr.PREFIX + SLIME_SEQ_METRICS[name]],
        _sample_mean(per_token, call.mask),
      )
    elif name in SLIME_CONST_METRICS:
      values = np.asarray(ref)
      assert np.ptp(values) == 0, name  # one constant for the batch
      cr.metric_close(
        name, out.metrics[cr.PREFIX + SLIME_CONST_METRICS[name]], values[0]
      )
  return 'parity'


@pytest.mark.golden('slime')
@pytest.mark.parametrize('case_id', cr.case_ids('slime'))
def test_slime(case_id):
  gs = gm.load('slime')
  _check_slime(gs, gs.case(case_id))
