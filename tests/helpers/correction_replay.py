"""The rollout-correction golden cases, selected, classified and compared
(tests/conformance/{verl,skyrl,slime}/test_correction.py).

Each case gets an *expectation* (`classify`):

* `legacy`: verl's older helper (9b718e1a7) mapped onto the k1 criteria and
  `veto_low`; masks and weights exact, metrics that kept their meaning;
* `parity`: masks exact, weights and every comparable metric within
  rtol = atol = 1e-6 (1e-5 for std / χ² metrics, README "dtypes and
  tolerances");
* `D1`: verl bounds π_rollout/π_train; the case is replayed with the band
  mirrored onto ρ (`invert_k1_bounds`), which must reproduce verl exactly;
  jaxcorr's own answer is asserted in
  tests/conformance/divergences/test_correction.py;
* `D17`: SkyRL combos; the parts computed before SkyRL's token masks agree;
* `raises`: the reference raised and jaxcorr raises a ValueError too;
* `diverges:<why>`: the spec deliberately chooses the other side of
  raise / no-raise (D2, D3, D8, D14, D16, geometric IS); jaxcorr's behaviour
  is asserted by the replay and its values in the divergence tests.

The eager (non-jit) path is used: one compile per config would cost minutes;
tests/losses/correction/test_properties.py checks that jit and eager agree.
"""

from __future__ import annotations

import functools

import numpy as np

from jaxcorr.losses import correction as corr
from tests.helpers import correction_golden_map as gm
from tests.helpers.tolerance import TOL_GOLDEN, TOL_GOLDEN_SPREAD, assert_close

PREFIX = corr.METRIC_PREFIX
VERL_GROUPS = (
  'preset',
  'is_grid',
  'rs_grid',
  'is_rs_combo',
  'offpolicy_metrics',
  'edge_all_rejected',
  'errors',
  'legacy',
)


def _is_correction_case(fw: str, case: dict) -> bool:
  cid = case['id']
  if fw == 'verl':
    if case['group'] not in VERL_GROUPS:
      return False
    loss_parts = ('/ppo_loss/', '/bypass_loss/', '/bypass_reinforce/')
    return not any(p in cid for p in loss_parts)
  if fw == 'skyrl':
    return case['group'] in ('opc', 'opc_part', 'opc_apply')
  return case['group'] in ('mis', 'tis')


@functools.cache
def case_ids(fw: str) -> tuple[str, ...]:
  """The ids of `fw`'s golden cases that concern the correction."""
  gs = gm.load(fw)
  return tuple(c['id'] for c in gs.cases() if _is_correction_case(fw, c))


# verl cases where jaxcorr deliberately takes the other side of raise/no-raise.
VERL_DIVERGES = {
  'rs_multi/token_k2,token_k2/0.02/main': ('D16', True),
  'offpolicy/no_rollout/main': ('D8', True),
  'error/is/token/None/main': ('D8', True),
  'error/all_zero_mask/main': ('D2', False),
  'all_rejected/offpolicy_metrics/main': ('D2/D14', False),
  'error/is/geometric/2.0/main': (
    'geometric IS level (slime), docs/math/correction.md §4.3',
    False,
  ),
  'is/token/icepop_s:1.0_1.0/bn_0/main': ('D3', False),
  'is/token/icepop_s:1.0_1.0/bn_1/main': ('D3', False),
  'is/sequence/icepop_s:1.0_1.0/bn_0/main': ('D3', False),
  'is/sequence/icepop_s:1.0_1.0/bn_1/main': ('D3', False),
}
SKYRL_D17 = {
  'opc/combo_tistoken_geo_outlier_tokmask',
  'opc/combo_tisseq_product_tokmask',
  'opc_apply/combo_tistoken_geo_outlier_tokmask',
}


def classify(fw: str, case: dict) -> tuple[str, str]:
  """`(kind, note)` for one case; kinds as in the module docstring."""
  cid = case['id']
  if fw == 'verl':
    if cid in VERL_DIVERGES:
      div, _ = VERL_DIVERGES[cid]
      return 'diverges', div
    if case.get('error') is not None:
      return 'raises', case['error']['type']
    if case['group'] == 'legacy':
      return 'legacy', 'masks, weights, shared-semantics metrics'
    kw = case.get('kwargs', {})
    rs, bounds = kw.get('rollout_rs'), kw.get('rollout_rs_threshold')
    # Presets are compared directly (docs/math/correction.md §9); their
    # 0.999_1.001 band is asymmetric by 1e-6 but no statistic of the batch falls
    # in between.
    if case['group'] != 'preset' and gm.verl_asymmetric_k1(rs, bounds):
      return 'D1', 'k1 band mirrored onto ρ'
    return 'parity', case['group']
  if fw == 'skyrl':
    if cid in SKYRL_D17:
      return 'D17', 'post-token-mask sequence statistics'
    if cid == 'opc_apply/rollout_logprobs_None_is_silent_noop':
      return 'diverges', 'D8'
    return 'parity', case['group']
  return 'parity', case['group']


def metric_close(name: str, ours, ref) -> None:
  """A correction metric against the reference's: std / χ²-type metrics
  within TOL_GOLDEN_SPREAD, every other within TOL_GOLDEN."""
  spread = 'std' in name or 'chi2' in name
  assert_close(
    ours, ref, TOL_GOLDEN_SPREAD if spread else TOL_GOLDEN, what=name
  )


def run_correction(call: gm.Call) -> corr.Correction:
  """`rollout_correction` (eager) on one mapped reference call."""
  cfg = corr.CorrectionConfig(**call.cfg)
  mask = np.asarray(call.mask).astype(bool)
  return corr.rollout_correction(call.train, call.rollout, mask, cfg)


def metric(out: corr.Correction, name: str) -> float:
  return float(out.metrics[PREFIX + name])


def check_weights(out, ref_w, where) -> None:
  """IS weights against the reference's at the `where` positions."""
  ours = np.asarray(out.weights)
  ref = np.broadcast_to(np.asarray(ref_w, np.float32), ours.shape)
  assert_close(ours[where], ref[where], what='weights')


def check_mask(ours, ref, what='mask') -> None:
  """Masks must match exactly; the failure names the positions."""
  ours, ref = np.asarray(ours, bool), np.asarray(ref) > 0
  bad = np.argwhere(ours != ref)
  assert bad.size == 0, f'{what} differs at {bad.tolist()}'
