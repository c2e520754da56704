"""The deliberate divergences of the correction (docs/math/correction.md §7).

One test per divergence that concerns `rollout_correction` (D1, D2, D3, D4,
D8, D14, D16, D17), each on the reference's own golden inputs. The expected
jaxcorr values are derived by hand here, in NumPy float64 from the spec's
formulas, and the reference's recorded behaviour is derived the same way to
show that the difference is exactly the documented one.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxcorr.losses import correction as corr
from tests.helpers import correction_golden_map as gm

P = corr.METRIC_PREFIX


def _verl_inputs():
  d = gm.load('verl').dataset()
  return d['old_log_prob'], d['rollout_log_prob'], d['response_mask'] > 0


def _run(train, rollout, mask, **cfg) -> corr.Correction:
  return corr.rollout_correction(
    train, rollout, mask, corr.CorrectionConfig(**cfg)
  )


def _log_ratio(train, rollout, mask) -> np.ndarray:
  """`r` as jaxcorr computes it: a float32 difference, 0 outside the mask."""
  return np.where(mask, train - rollout, 0).astype(np.float32)


def _vmean(y, valid):
  return y[valid].sum() / valid.sum()


def _rmean(x, mask):
  return (x * mask).sum(-1, dtype=np.float64) / np.maximum(mask.sum(-1), 1)


# -------------------------------------------------------------------- D1


def test_d1_k1_band_bounds_the_ratio_not_its_inverse():
  """verl's `0.6_1.4` on token_k1 bounds π_rollout/π_old; jaxcorr bounds ρ.

  verl (`rs/token_k1/s:0.6_1.4/main`) rejects ρ = 0.623 at (0, 12) and keeps
  ρ = 1.509 at (5, 0); jaxcorr keeps the first and rejects the second.
  """
  gs = gm.load('verl')
  case = gs.case('rs/token_k1/s:0.6_1.4/main')
  train, rollout, m = _verl_inputs()
  out = _run(train, rollout, m, rs='token_k1', rs_bounds='0.6_1.4')
  r = _log_ratio(train, rollout, m).astype(np.float64)
  rho = np.exp(r)
  assert rho[0, 12] == pytest.approx(0.623, abs=1e-3)
  assert rho[5, 0] == pytest.approx(1.509, abs=1e-3)

  ours = np.asarray(out.mask)
  assert ours[0, 12] and not ours[5, 0]
  # Hand-derived rules: jaxcorr lo ≤ ρ ≤ up, verl lo ≤ 1/ρ ≤ up.
  np.testing.assert_array_equal(ours, m & (rho >= 0.6) & (rho <= 1.4))
  verl = gs.outputs(case)['modified_response_mask'] > 0
  assert not verl[0, 12] and verl[5, 0]
  np.testing.assert_array_equal(verl, m & (1 / rho >= 0.6) & (1 / rho <= 1.4))

  # Metrics name "high"/"low" after the statistic k1 = −r: its band is
  # [−log 1.4, −log 0.6].
  k1 = -r
  n = m.sum()
  hi, lo = -np.log(0.6), -np.log(1.4)
  got = {k[len(P) :]: float(v) for k, v in out.metrics.items()}
  assert got['rollout_rs_token_k1_fraction_high'] == pytest.approx(
    (k1[m] > hi).sum() / n, abs=1e-7
  )
  assert got['rollout_rs_token_k1_fraction_low'] == pytest.approx(
    (k1[m] < lo).sum() / n, abs=1e-7
  )
  assert got['rollout_rs_token_k1_masked_fraction'] == pytest.approx(
    (~ours[m]).sum() / n, abs=1e-7
  )
  ref = gs.metrics(case)['rollout_corr/rollout_rs_token_k1_fraction_high']
  assert got['rollout_rs_token_k1_fraction_high'] != pytest.approx(ref)


def test_d1_sequence_product_band():
  """`seq_sum_k1` with `0.6_1.4` keeps rows with 0.6 ≤ Π_t ρ_t ≤ 1.4."""
  gs = gm.load('verl')
  case = gs.case('rs/seq_sum_k1/s:0.6_1.4/main')
  train, rollout, m = _verl_inputs()
  out = _run(train, rollout, m, rs='seq_sum_k1', rs_bounds='0.6_1.4')
  s = _log_ratio(train, rollout, m).astype(np.float64).sum(-1)
  prod = np.exp(s)
  ours_rows = (prod >= 0.6) & (prod <= 1.4)
  verl_rows = (1 / prod >= 0.6) & (1 / prod <= 1.4)
  assert (ours_rows != verl_rows).any()
  np.testing.assert_array_equal(np.asarray(out.mask), m & ours_rows[:, None])
  verl = gs.outputs(case)['modified_response_mask'] > 0
  np.testing.assert_array_equal(verl, m & verl_rows[:, None])


# -------------------------------------------------------------------- D2


def test_d2_everything_masked_or_rejected():
  """verl raises on an all-zero mask (`error/all_zero_mask/main`) and asserts
  in its metrics (`all_rejected/offpolicy_metrics/main`); jaxcorr returns
  nothing kept, weights 0 and finite metrics, all exactly 0 when nothing is
  valid.
  """
  gs = gm.load('verl')
  assert gs.case('error/all_zero_mask/main')['error']['type'] == 'ValueError'
  train, rollout, m = _verl_inputs()
  empty = np.zeros_like(m)
  out = _run(train, rollout, empty, is_level='token', is_upper=2.0)
  assert not np.asarray(out.mask).any()
  assert not np.asarray(out.weights).any()
  for name, v in out.metrics.items():
    assert float(v) == 0.0, name

  # Everything rejected (`all_rejected/correction/main`: seq_max_k2 ≤ 1e-20).
  case = gs.case('all_rejected/correction/main')
  out = _run(
    train, rollout, m, is_level='token', rs='seq_max_k2', rs_bounds=1e-20
  )
  np.testing.assert_array_equal(
    np.asarray(out.mask), gs.outputs(case)['modified_response_mask'] > 0
  )
  assert not np.asarray(out.mask).any()
  assert not np.asarray(out.weights).any()
  got = {k[len(P) :]: float(v) for k, v in out.metrics.items()}
  assert got['rejected_token_fraction'] == 1.0
  assert got['rejected_seq_fraction'] == 1.0
  assert got['rollout_rs_masked_fraction'] == 1.0
  assert all(np.isfinite(v) for v in got.values())


# -------------------------------------------------------------------- D3


@pytest.mark.parametrize('level', ['token', 'sequence'])
@pytest.mark.parametrize('batch_norm', [False, True])
def test_d3_icepop_everything_out_of_band(level, batch_norm):
  """`is/<level>/icepop_s:1.0_1.0/bn_*`: verl raises ZeroDivisionError.

  With [Cl, Cu] = [1, 1] only ratios of exactly 1 keep their weight; this
  batch has none, so every weight is 0, the ESS is 0, every token is out of
  band, the mask is untouched and batch normalisation (μ = 0) is skipped.
  """
  gs = gm.load('verl')
  case = gs.case(f'is/{level}/icepop_s:1.0_1.0/bn_{int(batch_norm)}/main')
  assert gs.error(case)['type'] == 'ZeroDivisionError'
  train, rollout, m = _verl_inputs()
  r = _log_ratio(train, rollout, m)
  ell = r if level == 'token' else r.sum(-1, keepdims=True) * m
  assert not (np.exp(ell)[m] == 1).any()  # no ratio is exactly 1
  out = _run(
    train,
    rollout,
    m,
    is_level=level,
    is_mode='mask',
    is_lower=1.0,
    is_upper=1.0,
    is_batch_normalize=batch_norm,
  )
  np.testing.assert_array_equal(np.asarray(out.mask), m)
  assert not np.asarray(out.weights).any()
  got = {k[len(P) :]: float(v) for k, v in out.metrics.items()}
  assert got['rollout_is_eff_sample_size'] == 0.0
  assert got['rollout_is_oob_ratio'] == 1.0
  assert got['rollout_is_mean'] == 0.0
  if batch_norm:
    assert got['rollout_is_batch_norm_factor'] == 1.0
  assert all(np.isfinite(v) for v in got.values())


# -------------------------------------------------------------------- D4


def test_d4_sequence_metrics_average_over_non_empty_rows():
  """verl averages sequence metrics over all B rows; jaxcorr over V.

  The verl `main` batch has no empty row, so one is made by masking row 2.
  """
  train, rollout, m = _verl_inputs()
  m = m.copy()
  m[2] = False
  valid = m.any(-1)
  assert valid.sum() == 7
  out = _run(
    train,
    rollout,
    m,
    is_level='token',
    is_upper=2.0,
    rs='seq_mean_k3',
    rs_bounds=0.01,
  )
  got = {k[len(P) :]: float(v) for k, v in out.metrics.items()}
  t64, r64 = train.astype(np.float64), rollout.astype(np.float64)
  r = _log_ratio(train, rollout, m).astype(np.float64)
  w = np.minimum(np.exp(r), 2.0) * m
  q = _rmean(w, m)
  nll_t = -_rmean(t64, m)
  d = _rmean(r64, m) - _rmean(t64, m)
  k3 = np.exp(r) - 1 - r
  failed = (m & (_rmean(k3, m) > 0.01)[:, None]).any(-1)
  s = r.sum(-1)
  hand = {  # jaxcorr: over V; verl: over B with the empty row's default
    'rollout_is_seq_mean': (_vmean(q, valid), q.sum() / 8),
    'training_ppl': (_vmean(np.exp(nll_t), valid), np.exp(nll_t).sum() / 8),
    'log_ppl_diff': (_vmean(d, valid), d.sum() / 8),
    'rollout_rs_seq_masked_fraction': (_vmean(failed, valid), failed.sum() / 8),
    'chi2_seq': (_vmean(np.exp(2 * s), valid) - 1, np.exp(2 * s).sum() / 8 - 1),
  }
  for name, (ours, verl_style) in hand.items():
    assert got[name] == pytest.approx(ours, rel=1e-5, abs=1e-6), name
    assert got[name] != pytest.approx(verl_style, rel=1e-4), name


# -------------------------------------------------------------------- D8


def test_d8_missing_rollout_logp_is_an_error():
  """verl and SkyRL silently skip the correction without rollout log-probs
  (`offpolicy/no_rollout/main`, `error/is/token/None/main`,
  `opc_apply/rollout_logprobs_None_is_silent_noop`); jaxcorr raises."""
  verl, skyrl = gm.load('verl'), gm.load('skyrl')
  assert verl.case('offpolicy/no_rollout/main').get('error') is None
  case = verl.case('error/is/token/None/main')
  assert case.get('error') is None
  assert verl.outputs(case)['rollout_is_weights'] is None  # IS silently off
  noop = skyrl.case('opc_apply/rollout_logprobs_None_is_silent_noop')
  kw, outs = skyrl.kwargs(noop), skyrl.outputs(noop)
  np.testing.assert_array_equal(outs['loss'], kw['loss'])  # silently skipped

  train, _, m = _verl_inputs()
  with pytest.raises(ValueError, match='rollout_logp'):
    _run(train, None, m, is_level='token')
  with pytest.raises(ValueError, match='is_upper'):
    corr.CorrectionConfig(is_level='token', is_upper=None)


def test_d8_non_finite_values_reject_their_row_and_are_counted():
  """A NaN / inf at a valid token removes that row only, and is counted."""
  gs = gm.load('verl')
  train, rollout, m = _verl_inputs()
  train, rollout = train.copy(), rollout.copy()
  rollout[2, 4] = np.nan
  train[6, 0] = np.inf
  train[1, 30] = np.nan  # padding (row 1 has 27 tokens): ignored
  out = _run(train, rollout, m, is_level='token', is_upper=2.0)
  bad = np.zeros(8, bool)
  bad[[2, 6]] = True
  mask = np.asarray(out.mask)
  np.testing.assert_array_equal(mask, m & ~bad[:, None])
  ref = gs.outputs(gs.case('preset/decoupled_token_is/main/correction'))
  np.testing.assert_allclose(
    np.asarray(out.weights)[mask], ref['rollout_is_weights'][mask], rtol=1e-6
  )
  got = {k[len(P) :]: float(v) for k, v in out.metrics.items()}
  assert got['nonfinite_rollout_logp_count'] == 1
  assert got['nonfinite_train_logp_count'] == 1
  assert got['nonfinite_seq_fraction'] == 2 / 8
  assert got['rejected_seq_fraction'] == 2 / 8
  kept = m & ~bad[:, None]
  r = _log_ratio(train, rollout, kept).astype(np.float64)
  assert got['kl'] == pytest.approx(-r[kept].mean(), rel=1e-5)
  assert got['rejected_token_fraction'] == pytest.approx(
    1 - kept.sum() / m.sum(), abs=1e-7
  )


# ------------------------------------------------------------------- D14


def test_d14_max_and_min_of_an_empty_set_are_zero():
  """`all_rejected/offpolicy_metrics/main`: verl asserts on the empty mask;
  jaxcorr's max / min reductions give 0 (and so does every mean)."""
  gs = gm.load('verl')
  case = gs.case('all_rejected/offpolicy_metrics/main')
  assert gs.error(case)['type'] == 'AssertionError'
  kw = gs.kwargs(case)
  empty = kw['response_mask'] > 0
  assert not empty.any()
  out = _run(
    kw['log_prob'],
    kw['rollout_log_prob'],
    empty,
    is_level='sequence',
    rs=('token_k1', 'seq_max_k2'),
    rs_bounds=('0.5_2.0', 0.5),
  )
  got = {k[len(P) :]: float(v) for k, v in out.metrics.items()}
  for name in (
    'log_ppl_diff_max',
    'log_ppl_diff_min',
    'rollout_is_seq_max',
    'rollout_is_seq_min',
    'rollout_rs_token_k1_max',
    'rollout_rs_token_k1_min',
    'rollout_rs_seq_max_k2_max',
    'rollout_rs_seq_max_k2_seq_max',
    'rollout_rs_seq_max_k2_seq_min',
  ):
    assert got[name] == 0.0, name
  # With one non-empty row left, max and min cover that row only.
  one = np.zeros_like(empty)
  one[0, :5] = True
  out = _run(kw['log_prob'], kw['rollout_log_prob'], one, is_level='token')
  d = (
    kw['rollout_log_prob'][0, :5].astype(np.float64).mean()
    - kw['log_prob'][0, :5].astype(np.float64).mean()
  )
  assert float(out.metrics[P + 'log_ppl_diff_max']) == pytest.approx(
    d, abs=1e-6
  )
  assert float(out.metrics[P + 'log_ppl_diff_min']) == pytest.approx(
    d, abs=1e-6
  )


# ------------------------------------------------------------------- D16


def test_d16_duplicate_criterion_is_an_error():
  """verl drops a repeated criterion (`rs_multi/token_k2,token_k2/0.02`);
  jaxcorr refuses it when the config is built."""
  gs = gm.load('verl')
  case = gs.case('rs_multi/token_k2,token_k2/0.02/main')
  with pytest.raises(ValueError, match=r'rs.*duplicate.*token_k2'):
    corr.CorrectionConfig(rs='token_k2,token_k2', rs_bounds='0.02')
  with pytest.raises(ValueError, match='duplicate'):
    corr.CorrectionConfig(rs=('token_k2', 'token_k2'), rs_bounds=(0.1, 0.2))
  # What verl computed is the de-duplicated criterion.
  train, rollout, m = _verl_inputs()
  out = _run(train, rollout, m, rs='token_k2', rs_bounds=0.02)
  r = _log_ratio(train, rollout, m).astype(np.float64)
  np.testing.assert_array_equal(np.asarray(out.mask), m & (0.5 * r * r <= 0.02))
  np.testing.assert_array_equal(
    np.asarray(out.mask), gs.outputs(case)['modified_response_mask'] > 0
  )


# ------------------------------------------------------------------- D17


def _skyrl_case(case_id):
  gs = gm.load('skyrl')
  case = gs.case(case_id)
  call = gm.skyrl_call(gs, case)
  return call, gs.outputs(case)


def test_d17_sequence_statistics_use_the_pre_rejection_mask():
  """SkyRL computes sequence TIS and the product mask after its token mask
  (`opc/combo_tisseq_product_tokmask`); jaxcorr uses the statistics mask."""
  call, outs = _skyrl_case('opc/combo_tisseq_product_tokmask')
  m = call.mask
  out = _run(call.train, call.rollout, m, **call.cfg)
  r = _log_ratio(call.train, call.rollout, m).astype(np.float64)
  tok_keep = (np.exp(r) >= 0.5) & (np.exp(r) <= 2.0)

  def rule(stat_mask):
    s = (r * stat_mask).sum(-1)
    seq_keep = (np.exp(s) >= 0.5) & (np.exp(s) <= 2.0)
    mask = m & tok_keep & seq_keep[:, None]
    return mask, np.minimum(np.exp(s), 5.0)

  ours_mask, ours_w = rule(m)
  skyrl_mask, skyrl_w = rule(m & tok_keep)
  assert (ours_mask != skyrl_mask).any()
  np.testing.assert_array_equal(np.asarray(out.mask), ours_mask)
  np.testing.assert_allclose(
    np.asarray(out.weights),
    np.where(ours_mask, ours_w[:, None], 0),
    rtol=1e-5,
  )
  np.testing.assert_array_equal(outs['loss_mask'] > 0, skyrl_mask)
  np.testing.assert_allclose(outs['tis_ratio'][:, 0], skyrl_w, rtol=1e-5)


def test_d17_geometric_mask_after_outlier_and_token_masks():
  """`opc/combo_tistoken_geo_outlier_tokmask`: SkyRL takes the geometric
  mean over the tokens left by its outlier and token masks."""
  call, outs = _skyrl_case('opc/combo_tistoken_geo_outlier_tokmask')
  m = call.mask
  out = _run(call.train, call.rollout, m, **call.cfg)
  r = _log_ratio(call.train, call.rollout, m).astype(np.float64)
  rho = np.exp(r)
  outlier = ((m & (rho < 1e-4)) | (m & (rho > 100))).any(-1)
  tok_keep = (rho >= 0.5) & (rho <= 2.0)

  def rule(stat_mask):
    g = (r * stat_mask).sum(-1) / np.maximum(stat_mask.sum(-1), 1)
    geo_keep = (np.exp(g) >= 0.9) & (np.exp(g) <= 1.1)
    return m & tok_keep & geo_keep[:, None] & ~outlier[:, None]

  ours = rule(m)
  skyrl = rule(m & tok_keep & ~outlier[:, None])
  assert (ours != skyrl).any()
  np.testing.assert_array_equal(np.asarray(out.mask), ours)
  np.testing.assert_array_equal(outs['loss_mask'] > 0, skyrl)


def test_d7_every_verl_config_error_is_raised_at_build_time():
  """D7: verl validates lazily, inside the first correction call; jaxcorr
  raises while the config is built, before any array is seen. Every verl
  `errors` case that raises a ValueError about the configuration raises
  from `CorrectionConfig(...)` alone, with the offending field named."""
  from tests.helpers import golden_data

  gs = golden_data.load('verl')
  checked = 0
  for case in gs.cases(group='errors', errors=True):
    err = gs.error(case)
    call = gm.verl_call(gs, case)
    data_error = 'mask' in err['message'] or 'shape' in err['message']
    if err['type'] != 'ValueError' or data_error:
      continue  # array errors (all-zero mask: D2; shapes: trace time)
    if case['id'] == 'error/is/geometric/2.0/main':
      # jaxcorr supports slime's geometric level (docs/math/correction.md §4.3)
      continue
    with pytest.raises(ValueError) as info:
      corr.CorrectionConfig(**call.cfg)
    fields = corr.CorrectionConfig.__dataclass_fields__
    named = [f for f in fields if f in str(info.value)]
    assert named, info.value
    checked += 1
  assert checked >= 15, checked
