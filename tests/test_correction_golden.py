"""Golden parity of `rollout_correction` with verl, SkyRL and slime.

Every golden case that concerns the correction is replayed (see the README of
the golden set): verl `preset` (correction parts), `is_grid`, `rs_grid`,
`is_rs_combo`, `offpolicy_metrics`, `edge_all_rejected` (correction parts),
`errors`, `legacy`; SkyRL `opc`, `opc_part`, `opc_apply`; slime `mis`, `tis`.

Each case gets an *expectation* (`classify`):

* `legacy`: verl's older helper (9b718e1a7) mapped onto the k1 criteria and
  `veto_low`; masks and weights exact, metrics that kept their meaning;
* `parity`: masks exact, weights and every comparable metric within
  rtol = atol = 1e-6 (1e-5 for std / χ² metrics, README "dtypes and
  tolerances");
* `D1`: verl bounds π_rollout/π_train; the case is replayed with the band
  mirrored onto ρ (`invert_k1_bounds`), which must reproduce verl exactly;
  jaxcorr's own answer is asserted in `test_correction_divergences.py`;
* `D17`: SkyRL combos; the parts computed before SkyRL's token masks agree;
* `raises`: the reference raised and jaxcorr raises a ValueError too;
* `diverges:<why>`: the spec deliberately chooses the other side of
  raise / no-raise (D2, D3, D8, D14, D16, geometric IS); jaxcorr's behaviour
  is asserted here and its values in the divergence tests.

The eager (non-jit) path is used: one compile per config would cost minutes;
`test_correction_properties.py` checks that jit and eager agree.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from jaxcorr.losses import correction as corr
from tests.helpers import correction_golden_map as gm

PREFIX = corr.METRIC_PREFIX
RTOL = 1e-6
LOOSE = 1e-5  # std / variance / χ²-type metrics (README)
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

# ------------------------------------------------------------ selection


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
  gs = gm.load(fw)
  return tuple(c['id'] for c in gs.cases() if _is_correction_case(fw, c))


# -------------------------------------------------------- expectations

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


# ---------------------------------------------------------- comparison


def _tol(name: str) -> float:
  return LOOSE if ('std' in name or 'chi2' in name) else RTOL


def _close(name: str, ours, ref) -> None:
  tol = _tol(name)
  np.testing.assert_allclose(
    np.asarray(ours, np.float64), ref, rtol=tol, atol=tol, err_msg=name
  )


def _run(call: gm.Call) -> corr.Correction:
  cfg = corr.CorrectionConfig(**call.cfg)
  mask = np.asarray(call.mask).astype(bool)
  return corr.rollout_correction(call.train, call.rollout, mask, cfg)


def _metric(out: corr.Correction, name: str) -> float:
  return float(out.metrics[PREFIX + name])


def _check_weights(out, ref_w, where) -> None:
  ours = np.asarray(out.weights)
  ref = np.broadcast_to(np.asarray(ref_w, np.float32), ours.shape)
  np.testing.assert_allclose(
    ours[where], ref[where], rtol=RTOL, atol=RTOL, err_msg='weights'
  )


def _check_mask(ours, ref, what='mask') -> None:
  ours, ref = np.asarray(ours, bool), np.asarray(ref) > 0
  bad = np.argwhere(ours != ref)
  assert bad.size == 0, f'{what} differs at {bad.tolist()}'


def _check_verl(gs, case: dict, kind: str) -> str:
  call = gm.verl_call(gs, case, verl_k1=kind == 'D1')
  out = _run(call)
  outs = gs.outputs(case)
  ref_metrics = gs.metrics(case) or {}
  legacy = case['group'] == 'legacy'
  ref_mask = outs.get('modified_response_mask', outs.get('response_mask'))
  if ref_mask is not None:
    _check_mask(out.mask, ref_mask)
  ref_w = outs.get('rollout_is_weights')
  om = np.asarray(out.mask)
  if ref_w is not None:
    _check_weights(out, ref_w, om)
  elif 'rollout_is_weights' in outs:  # IS off: weights are the kept mask
    np.testing.assert_array_equal(
      np.asarray(out.weights), om.astype(np.float32)
    )
  ours = {k[len(PREFIX) :] for k in out.metrics}
  refs = {k.removeprefix(PREFIX): v for k, v in ref_metrics.items()}
  if legacy:
    for name, v in refs.items():
      if name not in LEGACY_SHARED:
        continue
      if name in ours:
        _close(name, out.metrics[PREFIX + name], v)
      else:  # legacy logs the veto metrics as 0 when the veto is off
        assert name.startswith('rollout_is_') and v == 0, (name, v)
    return 'legacy: masks, weights, shared-semantics metrics'
  missing = set(refs) - ours
  assert not missing, f'reference metrics missing in jaxcorr: {missing}'
  for name, v in refs.items():
    _close(name, out.metrics[PREFIX + name], v)
  prefixed = next(iter(ref_metrics), PREFIX).startswith(PREFIX)
  if prefixed and ref_metrics:  # a full metric dict: same key set + new ones
    extra = ours - set(refs)
    assert extra <= NEW_KEYS, f'unexpected jaxcorr metrics: {extra - NEW_KEYS}'
  return kind


def _check_verl_diverges(gs, case: dict, why: str, raises: bool) -> str:
  if raises:
    with pytest.raises(ValueError):
      _run(gm.verl_call(gs, case))
    return why
  out = _run(gm.verl_call(gs, case))
  for name, v in out.metrics.items():
    assert np.isfinite(np.asarray(v)), name
  assert np.isfinite(np.asarray(out.weights)).all()
  if why == 'D3':  # ZeroDivisionError in verl's ESS; everything out of band
    assert _metric(out, 'rollout_is_eff_sample_size') == 0.0
  if why.startswith('D2'):  # nothing valid: nothing kept, every metric 0
    assert not np.asarray(out.mask).any()
    assert all(float(v) == 0.0 for v in out.metrics.values())
  if why.startswith('geometric'):  # verl has no geometric IS; slime's value
    assert np.asarray(out.mask).any()
  return why


def _skyrl_metrics(out, met: dict, cfg: dict, only=None) -> None:
  for name, v in met.items():
    if name in SKYRL_UNMAPPED or (only is not None and name not in only):
      continue
    ours = SKYRL_METRICS[name]
    if name == 'outlier_seq_masked_ratio':
      assert 'rs' not in cfg and 'is_level' not in cfg, 'veto must be alone'
    if PREFIX + ours in out.metrics:
      _close(name, out.metrics[PREFIX + ours], v)
    else:  # SkyRL logs the side that is off as 0
      assert v == 0.0, (name, v)


def _check_skyrl(gs, case: dict, kind: str) -> str:
  call = gm.skyrl_call(gs, case)
  outs = gs.outputs(case)
  if kind == 'diverges':  # D8: SkyRL silently skips; jaxcorr raises
    with pytest.raises(ValueError, match='rollout_logp'):
      _run(call)
    np.testing.assert_array_equal(outs['loss_mask'] > 0, call.mask)
    return 'D8'
  out = _run(call)
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
      _check_weights(out, outs['tis_ratio'], both)
    else:
      kw = gs.kwargs(case)
      np.testing.assert_allclose(
        (kw['loss'] * np.asarray(out.weights))[both],
        outs['loss'][both],
        rtol=RTOL,
        atol=RTOL,
      )
    _skyrl_metrics(out, met, call.cfg, only={'outlier_seq_over_high_ratio'})
    return 'D17'
  loss_mask = call.mask
  if group == 'opc':
    _check_mask(om, outs['loss_mask'], 'loss_mask')
    if outs['tis_ratio'] is None:
      assert 'is_level' not in call.cfg
    else:
      _check_weights(out, outs['tis_ratio'], om)
    _skyrl_metrics(out, met, call.cfg)
  elif group == 'opc_part':
    if 'tis_ratio' in outs:
      _check_weights(out, outs['tis_ratio'], om)
    for key in ('sequence_mask', 'outlier_mask', 'token_mask'):
      if key in outs:
        ref = np.broadcast_to(outs[key], om.shape) > 0
        _check_mask(om, ref & loss_mask, key)
    _skyrl_metrics(out, met, call.cfg)
  else:  # opc_apply: loss · tis_ratio, new loss_mask
    _check_mask(om, outs['loss_mask'], 'loss_mask')
    kw = gs.kwargs(case)
    np.testing.assert_allclose(
      (kw['loss'] * np.asarray(out.weights))[om],
      outs['loss'][om],
      rtol=RTOL,
      atol=RTOL,
    )
    _skyrl_metrics(out, met, call.cfg)
  return 'parity'


def _sample_mean(x: np.ndarray, mask: np.ndarray) -> float:
  """slime's reducer: the mean over samples of each sample's masked mean."""
  n = mask.sum(-1)
  return float(np.mean((x * mask).sum(-1) / np.maximum(n, 1)))


def _check_slime(gs, case: dict) -> str:
  call = gm.slime_call(gs, case)  # padding filled with NaN on purpose
  out = _run(call)
  outs = gs.outputs(case)
  om, ow = np.asarray(out.mask), np.asarray(out.weights)
  if case['group'] == 'tis':
    kw = gs.kwargs(case)
    pg_in = gm.slime_rows(gs, kw['pg_loss'])
    pg_out = gm.slime_rows(gs, outs['pg_loss'])
    _check_mask(om, call.mask)  # masks are returned unchanged
    np.testing.assert_allclose(
      (pg_in * ow)[om], pg_out[om], rtol=RTOL, atol=RTOL
    )
    return 'parity'
  ref_mask = gm.slime_rows(gs, outs['modified_masks']) > 0
  if call.cfg.get('is_mode') == 'mask':
    # slime zeroes the mask of out-of-band tokens and keeps the raw weight;
    # jaxcorr (verl) keeps the token and zeroes its weight
    # (docs/math/correction.md §4.3).
    _check_mask(om & (ow > 0), ref_mask)
  else:
    _check_mask(om, ref_mask)
  if outs['weights'] is not None:
    _check_weights(out, gm.slime_rows(gs, outs['weights']), ref_mask)
  else:
    assert 'is_level' not in call.cfg
  for key, ref in outs.items():
    name = key.removeprefix('metric_')
    if name in SLIME_SEQ_METRICS:
      per_token = gm.slime_rows(gs, ref)
      _close(
        name,
        out.metrics[PREFIX + SLIME_SEQ_METRICS[name]],
        _sample_mean(per_token, call.mask),
      )
    elif name in SLIME_CONST_METRICS:
      values = np.asarray(ref)
      assert np.ptp(values) == 0, name  # one constant for the batch
      _close(name, out.metrics[PREFIX + SLIME_CONST_METRICS[name]], values[0])
  return 'parity'


@functools.cache
def run_case(fw: str, case_id: str) -> tuple[str, str]:
  """Replays one case; returns `(kind, note)` or raises AssertionError."""
  gs = gm.load(fw)
  case = gs.case(case_id)
  kind, note = classify(fw, case)
  if fw == 'verl':
    if kind == 'diverges':
      why, raises = VERL_DIVERGES[case_id]
      return kind, _check_verl_diverges(gs, case, why, raises)
    if kind == 'raises':
      with pytest.raises(ValueError):
        _run(gm.verl_call(gs, case))
      return kind, note
    return kind, _check_verl(gs, case, kind)
  if fw == 'skyrl':
    return kind, _check_skyrl(gs, case, kind)
  return kind, _check_slime(gs, case)


# ---------------------------------------------------------------- tests


@pytest.mark.golden('verl')
@pytest.mark.parametrize('case_id', case_ids('verl'))
def test_verl(case_id):
  run_case('verl', case_id)


@pytest.mark.golden('skyrl')
@pytest.mark.parametrize('case_id', case_ids('skyrl'))
def test_skyrl(case_id):
  run_case('skyrl', case_id)


@pytest.mark.golden('slime')
@pytest.mark.parametrize('case_id', case_ids('slime'))
def test_slime(case_id):
  run_case('slime', case_id)


def test_case_selection_is_complete():
  """Every correction case of the golden set is replayed, none twice."""
  counts = {fw: len(case_ids(fw)) for fw in ('verl', 'skyrl', 'slime')}
  # verl: 20 preset corrections, 30 is_grid, 50 rs_grid, 10 is_rs_combo,
  # 3 offpolicy, 2 edge_all_rejected, 23 errors, 34 legacy.
  assert counts == {'verl': 172, 'skyrl': 26, 'slime': 16}, counts
  for fw in counts:
    assert len(set(case_ids(fw))) == counts[fw]
