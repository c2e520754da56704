"""The actor objective against verl's goldens.

Every preset's `ppo_loss` (decoupled: vanilla PPO on the corrected mask ×
weights) and `bypass_loss` (the `bypass_mode` loss = bypass
`actor_objective`), `ploss/bypass_mode/*`, `ploss_gbi/bypass_mode/*`,
`kl_loss/*` and `edge_all_rejected/*` (D2).
"""

import dataclasses
import math

import jax
import numpy as np
import pytest

from jaxcorr.losses import aggregate as agg_lib
from jaxcorr.losses import correction as corr_lib
from jaxcorr.losses import objective as obj
from jaxcorr.losses import objective_config as obj_cfg
from tests.helpers import golden_data as gd
from tests.helpers import objective_batches as ob
from tests.helpers.tolerance import TOL_GOLDEN_METRICS, assert_close

VERL = gd.load('verl')
V = VERL.dataset()
V_MASK = V['response_mask'].astype(bool)


def _verl_params(predicate):
  mark = pytest.mark.golden('verl')
  return [
    pytest.param(c, id=c['id'], marks=mark)
    for c in VERL.cases()
    if predicate(c['id'])
  ]


def _verl_rc(rc: dict, **extra) -> corr_lib.CorrectionConfig:
  """verl's RolloutCorrectionConfig fields -> CorrectionConfig."""
  kw = {}
  if rc.get('rollout_is') is not None:
    kw['is_level'] = rc['rollout_is']
    thr = rc['rollout_is_threshold']
    if isinstance(thr, str) and '_' in thr:  # 'lo_up': IcePop
      lo, up = thr.split('_')
      kw.update(is_mode='mask', is_lower=float(lo), is_upper=float(up))
    else:
      kw.update(is_mode='truncate', is_upper=float(thr))
    kw['is_batch_normalize'] = rc.get('rollout_is_batch_normalize', False)
  if rc.get('rollout_rs') is not None:
    kw['rs'] = rc['rollout_rs']
    kw['rs_bounds'] = rc['rollout_rs_threshold']
  kw.update(extra)
  return corr_lib.CorrectionConfig(**kw)


def _verl_preset(name):
  if name == '__default__':  # verl's dataclass default: sequence TIS, 2.0
    cc = corr_lib.CorrectionConfig(is_level='sequence', is_upper=2.0)
    return obj_cfg.ActorLossConfig(), cc
  return ob.preset(name)


def _compare_metrics(got, want, *, skip=()):
  missing = [k for k in want if k not in got and k not in skip]
  assert not missing, f'metrics missing: {missing}'
  for k, v in want.items():
    if k in skip:
      continue
    assert_close(got[k], v, TOL_GOLDEN_METRICS)


@pytest.mark.parametrize(
  'case', _verl_params(lambda i: i.startswith('preset/') and '/ppo_loss/' in i)
)
def test_verl_preset_decoupled_ppo_loss(case):
  """Our preset -> our correction -> actor_objective == verl's pipeline."""
  name, agg = case['id'].split('/')[1], case['id'].split('/')[-1]
  actor, cc = _verl_preset(name)
  assert cc.mode == 'decoupled'
  actor = dataclasses.replace(actor, agg=agg)
  corr = corr_lib.rollout_correction(
    V['old_log_prob'], V['rollout_log_prob'], V_MASK, cc
  )
  kw = VERL.kwargs(case)
  np.testing.assert_array_equal(corr.mask, kw['response_mask'].astype(bool))
  if kw['rollout_is_weights'] is not None:
    keep = np.asarray(corr.mask)
    assert_close(
      np.where(keep, corr.weights, 0),
      np.where(keep, kw['rollout_is_weights'], 0),
    )
  loss, met, grad = ob.grad_logp(
    actor,
    cc,
    V['log_prob'],
    advantages=V['advantages'],
    mask=V_MASK,
    old_logp=V['old_log_prob'],
    correction=corr,
  )
  out = VERL.outputs(case)
  scale = np.sum(np.abs(V['advantages']) * V_MASK) * 3
  assert_close(loss, out['loss'], scale=scale if agg == 'token-sum' else None)
  assert_close(grad, out['grad_log_prob'])
  _compare_metrics(met, VERL.metrics(case))


def _all_rejected_in_verl(case) -> bool:
  return math.isnan(VERL.outputs(case)['loss'])


@pytest.mark.parametrize(
  'case',
  _verl_params(lambda i: i.startswith('preset/') and '/bypass_loss/' in i),
)
def test_verl_preset_bypass_loss(case):
  """Our bypass preset == verl's `bypass_mode` loss (D2 where all rejected)."""
  name, agg = case['id'].split('/')[1], case['id'].split('/')[-1]
  actor, cc = ob.preset(name)
  assert cc.mode == 'bypass'
  actor = dataclasses.replace(actor, agg=agg)
  loss, met, grad = ob.grad_logp(
    actor,
    cc,
    V['log_prob'],
    advantages=V['advantages'],
    mask=V_MASK,
    rollout_logp=V['rollout_log_prob'],
  )
  out = VERL.outputs(case)
  internal = VERL.outputs(VERL.case(f'preset/{name}/main/internal_correction'))
  assert np.isfinite(np.asarray(loss))
  if _all_rejected_in_verl(case) or (
    agg == 'token-sum' and not internal['modified_response_mask'].any()
  ):
    # D2: verl rejects every row inside the loss and returns 0/0 = NaN
    # (token-sum gives 0.0); jaxcorr returns exactly 0 with zero gradients.
    assert not internal['modified_response_mask'].any()
    assert float(loss) == 0.0 and not np.any(grad)
    assert met['actor/loss_token_count'] == 0
    assert all(np.isfinite(np.asarray(v)) for v in met.values())
    return
  scale = np.sum(np.abs(V['advantages'] * V['log_prob']) * V_MASK) * 2
  assert_close(loss, out['loss'], scale=scale if agg == 'token-sum' else None)
  assert_close(grad, out['grad_log_prob'])
  _compare_metrics(met, VERL.metrics(case))


def _verl_bypass_rc(case):
  # The `bypass_mode` loss runs bypass whatever rc.bypass_mode says.
  rc = VERL.kwargs(case)['config']['policy_loss']['rollout_correction']
  return _verl_rc(rc, mode='bypass', bypass_loss=rc['loss_type'])


@pytest.mark.parametrize(
  'case', _verl_params(lambda i: i.startswith('ploss/bypass_mode/'))
)
def test_verl_ploss_bypass_mode(case):
  kw = VERL.kwargs(case)
  err = VERL.error(case)
  if err is not None:
    # verl: "Invalid loss_type: pg. Must be 'reinforce' or 'ppo_clip'."
    assert 'loss_type' in err['message']
    with pytest.raises(
      ValueError, match=r"bypass_loss.*'ppo_clip', 'reinforce'"
    ):
      _verl_bypass_rc(case)
    return
  cc = _verl_bypass_rc(case)
  name = 'reinforce' if cc.bypass_loss == 'reinforce' else 'vanilla'
  actor = obj_cfg.ActorLossConfig(policy_loss=name, agg=kw['loss_agg_mode'])
  loss, met, grad = ob.grad_logp(
    actor,
    cc,
    kw['log_prob'],
    advantages=kw['advantages'],
    mask=kw['response_mask'].astype(bool),
    rollout_logp=kw['old_log_prob'],  # verl's bypass: old_log_prob IS μ
  )
  out = VERL.outputs(case)
  scale = np.sum(np.abs(kw['advantages'] * kw['log_prob']) * V_MASK) * 2
  sum_mode = kw['loss_agg_mode'] == 'token-sum'
  assert_close(loss, out['loss'], scale=scale if sum_mode else None)
  assert_close(grad, out['grad_log_prob'])
  _compare_metrics(met, VERL.metrics(case))


@pytest.mark.parametrize(
  'case', _verl_params(lambda i: i.startswith('ploss_gbi/bypass_mode/'))
)
def test_verl_ploss_gbi_bypass_mode(case):
  """Local normalisation matches; verl's global counts diverge (D5)."""
  kw = VERL.kwargs(case)
  gbi = kw['config']['global_batch_info']
  mode = agg_lib.canonical_mode(kw['loss_agg_mode'])
  cc = _verl_bypass_rc(case)
  actor = obj_cfg.ActorLossConfig(policy_loss='reinforce', agg=mode)
  args = dict(
    advantages=kw['advantages'],
    mask=kw['response_mask'].astype(bool),
    rollout_logp=kw['old_log_prob'],
    norm=gbi['loss_scale_factor'],
  )
  want = VERL.outputs(case)['loss']
  loss, met, grad = ob.grad_logp(actor, cc, kw['log_prob'], **args)
  _compare_metrics(met, VERL.metrics(case))
  if gbi['batch_num_tokens'] is None:  # dp1_lsf16: local counts, parity
    assert_close(loss, want, scale=10.0)
    assert_close(grad, VERL.outputs(case)['grad_log_prob'])
    return
  # dp2_global. verl divides by the engine's counts, taken on the response
  # mask *before* rejection (311 tokens, 17 rows over 2 ranks); passing
  # those per-rank counts to jaxcorr reproduces verl's number ...
  dp = gbi['dp_size']
  verl_like = obj.actor_objective(
    actor,
    cc,
    logp=kw['log_prob'],
    num_tokens=gbi['batch_num_tokens'] / dp,
    num_seqs=gbi['global_batch_size'] / dp,
    **args,
  )[0]
  assert_close(verl_like * (dp if mode == 'token_sum' else 1), want, scale=10.0)
  # ... but jaxcorr's own normalisers come from the corrected mask (D5).
  corr = corr_lib.rollout_correction(
    kw['log_prob'], kw['old_log_prob'], args['mask'], cc
  )
  n_tok, n_seq = obj.loss_normalizers(corr.mask)
  own, _ = obj.actor_objective(
    actor, cc, logp=kw['log_prob'], num_tokens=n_tok, num_seqs=n_seq, **args
  )
  # Hand derivation: REINFORCE with token TIS (cap 2) on the rows whose
  # mean k3 is <= 0.01.
  r = np.where(args['mask'], kw['log_prob'] - kw['old_log_prob'], 0)
  r = r.astype(np.float64)
  k3 = np.exp(r) - 1 - r
  keep_rows = (k3 * args['mask']).sum(-1) / args['mask'].sum(-1) <= 0.01
  m = args['mask'] & keep_rows[:, None]
  assert 0 < m.sum() < args['mask'].sum()
  w = np.minimum(np.exp(r), 2.0)
  per_tok = -kw['advantages'] * kw['log_prob'] * w
  assert_close(own, ob.np_aggregate(per_tok, m, mode))
  np.testing.assert_array_equal(corr.mask, m)
  if mode != 'token_sum':
    assert abs(float(own) - want) > 1e-3  # the documented divergence


@pytest.mark.parametrize(
  'case', _verl_params(lambda i: i.startswith('kl_loss/'))
)
def test_verl_kl_loss(case):
  """Reference-KL term: kl_penalty + agg_loss, scaled by kl_loss_coef."""
  kw = VERL.kwargs(case)
  actor = obj_cfg.ActorLossConfig(
    agg=kw['loss_agg_mode'],
    kl_loss_type=kw['kl_loss_type'],
    kl_loss_coef=kw['kl_loss_coef'],
  )
  # A = 0 makes the pg term exactly 0 (value and gradient), isolating KL.
  loss, met, grad = ob.grad_logp(
    actor,
    None,
    kw['logprob'],
    advantages=np.zeros_like(kw['logprob']),
    mask=V_MASK,
    old_logp=V['old_log_prob'],
    ref_logp=kw['ref_logprob'],
  )
  out = VERL.outputs(case)
  assert float(met['actor/pg_loss']) == 0.0
  assert_close(met['actor/kl_loss'], out['kl_loss'], scale=10.0)
  assert_close(loss, out['kl_loss_times_coef'], scale=1e-2)
  assert_close(met['actor/kl_coef'], kw['kl_loss_coef'])
  assert_close(grad, out['grad_log_prob'])


def _all_rejected_cfg(mode: str) -> corr_lib.CorrectionConfig:
  # verl: token TIS 2.0 + seq_max_k2 <= 1e-20, which rejects every row.
  extra = {'mode': 'bypass', 'bypass_loss': 'reinforce'} if mode else {}
  return corr_lib.CorrectionConfig(
    is_level='token', is_upper=2.0, rs='seq_max_k2', rs_bounds=1e-20, **extra
  )


@pytest.mark.parametrize(
  'case',
  _verl_params(
    lambda i: (
      i.startswith('all_rejected/ppo_loss/')
      or i.startswith('all_rejected/bypass_reinforce/')
    )
  ),
)
def test_verl_edge_all_rejected(case):
  """D2: verl gives 0/0 = NaN (0.0 for token-sum); jaxcorr exactly 0."""
  kw = VERL.kwargs(case)
  bypass = '/bypass_reinforce/' in case['id']
  cc = _all_rejected_cfg('bypass' if bypass else '')
  actor = obj_cfg.ActorLossConfig(
    policy_loss='reinforce' if bypass else 'vanilla',
    agg=kw['loss_agg_mode'],
    entropy_coeff=0.01,
    kl_loss_coef=0.1,
    rollout_kl_coef=0.1,
  )
  args = dict(
    advantages=V['advantages'],
    mask=V_MASK,
    rollout_logp=V['rollout_log_prob'],
    ref_logp=V['ref_log_prob'],
  )
  if not bypass:
    corr = corr_lib.rollout_correction(
      V['old_log_prob'], V['rollout_log_prob'], V_MASK, cc
    )
    assert not np.asarray(corr.mask).any()
    np.testing.assert_array_equal(corr.mask, kw['response_mask'].astype(bool))
    args.update(old_logp=V['old_log_prob'], correction=corr)

  def f(lp, ent):
    return obj.actor_objective(actor, cc, logp=lp, entropy=ent, **args)

  ent = np.ones_like(V['log_prob'])
  (loss, met), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
    V['log_prob'], ent
  )
  want = VERL.outputs(case)['loss']
  assert math.isnan(want) or want == 0.0  # what verl does
  assert float(loss) == 0.0
  for g in grads:
    assert not np.any(np.asarray(g))
  for k in ('pg_loss', 'entropy', 'kl_loss', 'rollout_kl_loss'):
    assert float(met[f'actor/{k}']) == 0.0
  assert all(np.isfinite(np.asarray(v)) for v in met.values())
