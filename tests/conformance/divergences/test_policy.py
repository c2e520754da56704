"""The deliberate divergences of the policy losses from verl (D9, D12): each
test checks a NumPy oracle against verl's golden, then asserts jaxcorr's own
value where it differs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxcorr.losses import policy
from tests.helpers import golden_data as gd
from tests.helpers import policy_replay as pr


def _np_aggregate(ell, mask, mode):
  """Independent numpy aggregation (docs/math/losses.md §2), for the divergence
  tests."""
  ell = np.where(mask, ell, 0.0).astype(np.float64)
  n = mask.sum(-1)
  rows = ell.sum(-1)
  valid = n > 0
  if mode == 'token-mean':
    return rows.sum() / mask.sum()
  if mode == 'token-sum':
    return rows.sum()
  if mode == 'seq-mean-token-mean':
    return (rows[valid] / n[valid]).sum() / valid.sum()
  seq = rows[valid].sum() / valid.sum()
  return seq / mask.shape[-1] if mode == 'seq-mean-token-sum-norm' else seq


def _np_per_token(name, logp, old, adv, mask, w, k):
  """numpy oracles of gspo / sapo / geo_mean (docs/math/losses.md §4.3)."""
  d = np.where(mask, logp - old, 0.0)
  n = np.maximum(mask.sum(-1), 1)
  if name == 'gspo':
    rho = np.exp(np.minimum(d.sum(-1) / n, 10.0))[:, None]
    lo, hi = 1 - k['clip_ratio_low'], 1 + k['clip_ratio_high']
    ell = np.maximum(-adv * rho, -adv * np.clip(rho, lo, hi))
  elif name == 'sapo':
    tau = np.where(adv > 0, k['tau_pos'], k['tau_neg'])
    rho = np.exp(d)
    ell = -(4 / tau) / (1 + np.exp(-tau * (rho - 1))) * adv
  else:  # geo_mean
    sgn = np.sign(adv)
    dc = np.clip(d, -k['clip_ratio_low'], k['clip_ratio_high'])
    xt = sgn * np.minimum(sgn * d, sgn * dc)
    rho = np.exp(np.where(mask, xt, 0).sum(-1) / n)
    row = -np.where(mask, adv, 0).sum(-1) / n * rho
    if w is not None:
      row = row * np.exp(np.where(mask, np.log(w + 1e-10), 0).sum(-1) / n)
    return np.broadcast_to(row[:, None], mask.shape)
  return ell if w is None else ell * w


def _verl_default(name, weighted):
  gs = gd.load('verl')
  suffix = 'w' if weighted else 'now'
  case = gs.case(f'ploss/{name}/default/token-mean/{suffix}/main')
  return pr.verl_call(case), gs.outputs(case)['loss']


@pytest.mark.parametrize('weighted', [False, True], ids=['now', 'w'])
@pytest.mark.parametrize('name', pr.VERL_IGNORES_AGG)
def test_d9_explicit_agg_is_honoured(name, weighted):
  """D9: verl's gspo/sapo/geo_mean ignore loss_agg_mode; jaxcorr honours it.

  The numpy oracle is first checked against verl's golden (its natural
  seq-mean-token-mean value), then jaxcorr with each explicit mode must equal
  the oracle aggregated with that mode — which differs from verl's value.
  """
  a, verl_value = _verl_default(name, weighted)
  knobs = dataclasses.asdict(policy.check_knobs(a['knobs']))
  args = (a['logp'], a['old'], a['adv'], a['mask'], a['w'], knobs)
  ell = _np_per_token(name, *args)
  natural = _np_aggregate(ell, a['mask'], 'seq-mean-token-mean')
  np.testing.assert_allclose(natural, verl_value, rtol=1e-5, atol=1e-6)
  differs = 0
  for mode in gd.load('verl').meta['loss_agg_modes']:
    got, _ = policy.policy_loss(
      name, a['logp'], a['old'], a['adv'], a['mask'], is_weights=a['w'],
      agg=mode, knobs=policy.check_knobs(a['knobs']),
    )  # fmt: skip
    want = _np_aggregate(ell, a['mask'], mode)
    scale = max(1.0, _np_aggregate(np.abs(ell), a['mask'], mode))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * scale)
    differs += not np.isclose(got, verl_value, rtol=1e-4, atol=0)
  assert differs >= 3  # the explicit mode really changes the value


@pytest.mark.parametrize('weighted', [False, True], ids=['now', 'w'])
def test_d12_geo_mean_averages_over_non_empty_rows(weighted):
  """D12: geo_mean's natural mode averages over non-empty rows (verl: B).

  On the golden inputs (no empty row) jaxcorr equals verl (asserted in
  `test_verl_policy_loss`); here rows 2 and 5 are emptied.
  """
  a, verl_value = _verl_default('geo_mean', weighted)
  knobs = dataclasses.asdict(policy.check_knobs(a['knobs']))
  rows = lambda m: _np_per_token(  # noqa: E731
    'geo_mean', a['logp'], a['old'], a['adv'], m, a['w'], knobs
  )[:, 0]
  np.testing.assert_allclose(
    rows(a['mask']).mean(), verl_value, rtol=1e-5, atol=1e-6
  )
  mask = a['mask'].copy()
  mask[[2, 5]] = False
  got, _ = policy.policy_loss(
    'geo_mean', a['logp'], a['old'], a['adv'], mask, is_weights=a['w'],
    knobs=policy.check_knobs(a['knobs']),
  )  # fmt: skip
  ell = rows(mask)
  keep = mask.any(-1)
  np.testing.assert_allclose(got, ell[keep].mean(), rtol=1e-5, atol=1e-6)
  verl_style = ell[keep].sum() / mask.shape[0]
  assert not np.isclose(got, verl_style, rtol=1e-3, atol=0)
