"""verl's preset arguments (golden) against jaxcorr's presets, field by
field."""

import pytest

from jaxcorr.losses import correction as corr_lib
from tests.helpers import golden_data as gd
from tests.helpers import objective_batches as ob


@pytest.mark.golden('verl')
@pytest.mark.parametrize('name', gd.load('verl').meta['presets'])
def test_verl_preset_configs_match_ours(name):
  """verl's preset arguments (golden) == our preset, field by field."""
  gs = gd.load('verl')
  ours = ob.preset(name).correction
  if ours.mode == 'decoupled':
    kw = gs.kwargs(gs.case(f'preset/{name}/main/correction'))
    rc = kw['rollout_corr_config']
  else:
    rc = gs.kwargs(gs.case(f'preset/{name}/main/internal_correction'))
  thr = rc['rollout_is_threshold']
  if rc['rollout_is'] is None:
    assert ours.is_level is None
  elif isinstance(thr, str):  # 'lo_up' = IcePop
    lo, up = (float(x) for x in thr.split('_'))
    assert (ours.is_level, ours.is_mode) == (rc['rollout_is'], 'mask')
    assert (ours.is_lower, ours.is_upper) == (lo, up)
  else:
    assert (ours.is_level, ours.is_mode) == (rc['rollout_is'], 'truncate')
    assert ours.is_upper == thr
  assert ours.is_batch_normalize == rc['rollout_is_batch_normalize']
  if rc['rollout_rs'] is None:
    assert ours.rs == () and ours.rs_bounds == ()
  else:
    want = corr_lib.CorrectionConfig(
      rs=rc['rollout_rs'], rs_bounds=rc['rollout_rs_threshold']
    )
    assert (ours.rs, ours.rs_bounds) == (want.rs, want.rs_bounds)
