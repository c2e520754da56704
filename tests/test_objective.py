"""Actor objective and value loss: goldens, divergences, JAX contracts.

Golden parity (tests/golden, read through golden_data):

* verl: every preset's `ppo_loss` (decoupled: vanilla PPO on the corrected
  mask × weights) and `bypass_loss` (the `bypass_mode` loss = bypass
  `actor_objective`), `ploss/bypass_mode/*`, `ploss_gbi/bypass_mode/*`,
  `kl_loss/*`, `edge_all_rejected/*` (D2);
* SkyRL: `rollout_kl_loss/*`, `compose/*` (D5), `critic/*`;
* slime: `e2e/*` (policy_loss_function + loss_function from packed logits);
* prime-rl: `head/compute_loss/default/rl_only`.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base as base_config
from configs import presets
from jaxcorr.config import convert
from jaxcorr.losses import aggregate as agg_lib
from jaxcorr.losses import correction as corr_lib
from jaxcorr.losses import objective as obj
from jaxcorr.losses import policy as pol
from jaxcorr.losses import value as val
from tests.helpers import golden_data as gd

TOL = dict(rtol=1e-6, atol=1e-6)
MET_TOL = dict(rtol=1e-5, atol=1e-6)  # std/χ²-type metrics (golden README)
MODES = agg_lib.MODES


def _close(got, want, *, scale=None, rtol=1e-6, atol=1e-6):
  """allclose; `scale` widens atol for sums of many cancelling terms."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if scale is not None:
    atol = max(atol, 1e-6 * float(scale))
  np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def _grad_logp(cfg, corr_cfg, logp, *, jit=False, **kw):
  """loss, metrics and d loss / d logp. `jit=True` for one-off shapes: one
  XLA compile is much cheaper than compiling every eager op anew."""

  def f(lp, kw):
    return obj.actor_objective(cfg, corr_cfg, logp=lp, **kw)

  vg = jax.value_and_grad(f, has_aux=True)
  (loss, metrics), grad = (jax.jit(vg) if jit else vg)(jnp.asarray(logp), kw)
  return loss, metrics, np.asarray(grad)


def _preset(name):
  """(ActorLossConfig, CorrectionConfig | None) of a jaxcorr preset."""
  return convert.losses(base_config.get_config(name))


# =================================================================== verl

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
    return obj.ActorLossConfig(), cc
  return _preset(name)


def _compare_metrics(got, want, *, skip=()):
  missing = [k for k in want if k not in got and k not in skip]
  assert not missing, f'metrics missing: {missing}'
  for k, v in want.items():
    if k in skip:
      continue
    _close(got[k], v, **MET_TOL)


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
    _close(
      np.where(keep, corr.weights, 0),
      np.where(keep, kw['rollout_is_weights'], 0),
    )
  loss, met, grad = _grad_logp(
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
  _close(loss, out['loss'], scale=scale if agg == 'token-sum' else None)
  _close(grad, out['grad_log_prob'])
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
  actor, cc = _preset(name)
  assert cc.mode == 'bypass'
  actor = dataclasses.replace(actor, agg=agg)
  loss, met, grad = _grad_logp(
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
  _close(loss, out['loss'], scale=scale if agg == 'token-sum' else None)
  _close(grad, out['grad_log_prob'])
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
  actor = obj.ActorLossConfig(policy_loss=name, agg=kw['loss_agg_mode'])
  loss, met, grad = _grad_logp(
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
  _close(loss, out['loss'], scale=scale if sum_mode else None)
  _close(grad, out['grad_log_prob'])
  _compare_metrics(met, VERL.metrics(case))


def _np_agg(per_tok, m, mode, *, n_tok=None, n_seq=None, norm=None):
  """A float64 numpy aggregation, written from the spec table."""
  per_tok = np.where(m, per_tok, 0.0).astype(np.float64)
  n_i = m.sum(-1)
  n_tok = m.sum() if n_tok is None else n_tok
  n_seq = (n_i > 0).sum() if n_seq is None else n_seq
  rows = per_tok.sum(-1)
  if mode == 'token_mean':
    return rows.sum() / n_tok if n_tok else 0.0
  if mode == 'token_sum':
    return rows.sum()
  if mode == 'seq_mean_token_mean':
    rows = np.where(n_i > 0, rows / np.maximum(n_i, 1), 0)
  out = rows.sum() / n_seq if n_seq else 0.0
  if mode == 'seq_mean_token_sum_norm':
    out /= per_tok.shape[-1] if norm is None else norm
  return out


@pytest.mark.parametrize(
  'case', _verl_params(lambda i: i.startswith('ploss_gbi/bypass_mode/'))
)
def test_verl_ploss_gbi_bypass_mode(case):
  """Local normalisation matches; verl's global counts diverge (D5)."""
  kw = VERL.kwargs(case)
  gbi = kw['config']['global_batch_info']
  mode = agg_lib.canonical_mode(kw['loss_agg_mode'])
  cc = _verl_bypass_rc(case)
  actor = obj.ActorLossConfig(policy_loss='reinforce', agg=mode)
  args = dict(
    advantages=kw['advantages'],
    mask=kw['response_mask'].astype(bool),
    rollout_logp=kw['old_log_prob'],
    norm=gbi['loss_scale_factor'],
  )
  want = VERL.outputs(case)['loss']
  loss, met, grad = _grad_logp(actor, cc, kw['log_prob'], **args)
  _compare_metrics(met, VERL.metrics(case))
  if gbi['batch_num_tokens'] is None:  # dp1_lsf16: local counts, parity
    _close(loss, want, scale=10.0)
    _close(grad, VERL.outputs(case)['grad_log_prob'])
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
  _close(verl_like * (dp if mode == 'token_sum' else 1), want, scale=10.0)
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
  _close(own, _np_agg(per_tok, m, mode))
  np.testing.assert_array_equal(corr.mask, m)
  if mode != 'token_sum':
    assert abs(float(own) - want) > 1e-3  # the documented divergence


@pytest.mark.parametrize(
  'case', _verl_params(lambda i: i.startswith('kl_loss/'))
)
def test_verl_kl_loss(case):
  """Reference-KL term: kl_penalty + agg_loss, scaled by kl_loss_coef."""
  kw = VERL.kwargs(case)
  actor = obj.ActorLossConfig(
    agg=kw['loss_agg_mode'],
    kl_loss_type=kw['kl_loss_type'],
    kl_loss_coef=kw['kl_loss_coef'],
  )
  # A = 0 makes the pg term exactly 0 (value and gradient), isolating KL.
  loss, met, grad = _grad_logp(
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
  _close(met['actor/kl_loss'], out['kl_loss'], scale=10.0)
  _close(loss, out['kl_loss_times_coef'], scale=1e-2)
  _close(met['actor/kl_coef'], kw['kl_loss_coef'])
  _close(grad, out['grad_log_prob'])


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
  actor = obj.ActorLossConfig(
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


# ================================================================== SkyRL

SKYRL = gd.load('skyrl')


def _skyrl_params(group):
  return gd.case_params('skyrl', group=group)


@pytest.mark.parametrize('case', _skyrl_params('rollout_kl_loss'))
def test_skyrl_rollout_kl_loss(case):
  """PR #1811's rollout-KL = Krol with agg='seq_mean_token_mean'."""
  kw = SKYRL.kwargs(case)
  mask = kw['loss_mask'].astype(bool)
  actor = obj.ActorLossConfig(
    agg='seq_mean_token_mean',
    rollout_kl_type=kw['rollout_kl_estimator_type'],
    rollout_kl_coef=1.0,
  )
  loss, met, grad = _grad_logp(
    actor,
    None,
    kw['log_probs'],
    advantages=np.zeros_like(kw['log_probs']),
    mask=mask,
    old_logp=kw['log_probs'],
    rollout_logp=kw['rollout_logprobs'],
  )
  out = SKYRL.outputs(case)
  _close(met['actor/rollout_kl_loss'], out['rollout_kl'])
  _close(loss, out['rollout_kl'])
  _close(grad, out['grad_cur_logprobs'])


SKYRL_COMBO = dict(
  is_level='token',
  is_upper=2.0,
  rs='token_k1,seq_mean_k1',
  rs_bounds='0.5_2.0,0.9_1.1',
  veto_low=1e-4,
  veto_high=100.0,
)
"""SkyRL `combo_tistoken_geo_outlier_tokmask`: token TIS (2), token mask
[0.5, 2], geometric mask [0.9, 1.1], outlier mask 1e-4 / 100."""


def _np_k3(lp, base):
  u = np.clip(base - lp, -20, 20)
  return np.clip(np.exp(u) - u - 1, -10, 10)


@pytest.mark.golden('skyrl')
def test_skyrl_compose_d5_divergence():
  """D5 on SkyRL's composition (policy + ref-KL k3 + rollout-KL k2).

  SkyRL keeps rejected tokens in the rollout-KL term (original loss_mask)
  and in its normalisers; jaxcorr removes them from every term and count.
  The jaxcorr value is derived by hand below.
  """
  case = SKYRL.case('compose/regular_token_mean_combo_refkl_k3_rolloutkl_k2')
  kw, out = SKYRL.kwargs(case), SKYRL.outputs(case)
  m0 = kw['loss_mask'].astype(bool)
  lp, old, ref, ro = (
    kw['log_probs'],
    kw['old_log_probs'],
    kw['ref_log_probs'],
    kw['rollout_logprobs'],
  )
  adv = kw['advantages_raw']
  # SkyRL's own composition: total = pg + 0.001·KL + 0.1·rollout-KL, with
  # the rollout-KL on the ORIGINAL mask (= the rollout_kl_loss/k2 golden).
  _close(
    out['policy_loss'] + 1e-3 * out['kl_loss'] + 0.1 * out['rollout_kl_loss'],
    out['total_loss'],
  )
  _close(
    out['rollout_kl_loss'],
    SKYRL.outputs(SKYRL.case('rollout_kl_loss/k2'))['rollout_kl'],
  )
  cc = corr_lib.CorrectionConfig(**SKYRL_COMBO)
  actor = obj.ActorLossConfig(
    clip_ratio_c=None,  # SkyRL 'regular' has no dual clip
    kl_loss_type='k3',
    kl_loss_coef=1e-3,
    rollout_kl_type='k2',
    rollout_kl_coef=0.1,
  )
  corr = corr_lib.rollout_correction(old, ro, m0, cc)
  loss, met, grad = _grad_logp(
    actor,
    cc,
    lp,
    advantages=adv,
    mask=m0,
    old_logp=old,
    rollout_logp=ro,
    ref_logp=ref,
    correction=corr,
  )
  # By hand: the correction (decoupled, π_old vs μ) ...
  r = np.where(m0, old - ro, 0).astype(np.float64)
  rh = np.clip(r, -20, 20)
  vetoed = (m0 & ((r < np.log(1e-4)) | (r > np.log(100.0)))).any(-1)
  tok_keep = (rh >= np.log(0.5)) & (rh <= np.log(2.0))
  geo = (rh * m0).sum(-1) / np.maximum(m0.sum(-1), 1)
  geo_keep = (geo >= np.log(0.9)) & (geo <= np.log(1.1))
  m = m0 & tok_keep & geo_keep[:, None] & ~vetoed[:, None]
  np.testing.assert_array_equal(corr.mask, m)
  assert 0 < m.sum() < m0.sum()
  w = np.minimum(np.exp(rh), 2.0)
  # ... then every term on the corrected mask, token_mean.
  ratio = np.exp(np.clip(lp - old, -20, 20).astype(np.float64))
  pg_tok = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.2)) * w
  kref = _np_k3(lp.astype(np.float64), ref)
  krol = 0.5 * np.square(lp.astype(np.float64) - ro)
  n = m.sum()
  want = (
    (pg_tok * m).sum() / n
    + 1e-3 * (kref * m).sum() / n
    + 0.1 * (krol * m).sum() / n
  )
  _close(loss, want)
  _close(met['actor/rollout_kl_loss'], (krol * m).sum() / n)
  assert abs(float(loss) - out['total_loss']) > 1e-3
  # Rejected tokens receive no gradient at all in jaxcorr; SkyRL's
  # rollout-KL still pulls on them.
  rejected = m0 & ~m
  assert not np.any(grad[rejected])
  assert np.any(out['grad_cur_logprobs'][rejected] != 0)


@pytest.mark.golden('skyrl')
def test_skyrl_compose_padding_microbatch():
  """A padding micro-batch (mask all False) contributes exactly 0."""
  case = SKYRL.case('compose/padding_microbatch')
  kw, out = SKYRL.kwargs(case), SKYRL.outputs(case)
  mask = kw['loss_mask'].astype(bool)
  assert not mask.any()
  cc = corr_lib.CorrectionConfig(is_level='token', is_upper=2.0)
  corr = jax.jit(corr_lib.rollout_correction, static_argnums=3)(
    kw['old_log_probs'], kw['rollout_logprobs'], mask, cc
  )
  actor = obj.ActorLossConfig(clip_ratio_c=None, rollout_kl_coef=0.1)
  loss, met, grad = _grad_logp(
    actor,
    cc,
    kw['log_probs'],
    jit=True,
    advantages=kw['advantages'],
    mask=mask,
    old_logp=kw['old_log_probs'],
    rollout_logp=kw['rollout_logprobs'],
    correction=corr,
    num_tokens=100.0,  # the global count of the real micro-batches
    num_seqs=8.0,
  )
  assert float(loss) == 0.0 == out['policy_loss'] == out['rollout_kl_loss']
  assert float(met['actor/rollout_kl_loss']) == 0.0
  np.testing.assert_array_equal(grad, out['grad'])
  assert not np.any(grad)


@pytest.mark.parametrize('case', _skyrl_params('critic'))
def test_skyrl_critic(case):
  """SkyRL = agg seq_mean_token_mean, ε = 0.2 (None: no clip = ε = inf)."""
  kw, out = SKYRL.kwargs(case), SKYRL.outputs(case)
  eps = kw['value_clip'] if kw['value_clip'] is not None else math.inf
  loss, met = val.value_loss(
    kw['values'],
    kw['old_values'],
    kw['returns'],
    kw['loss_mask'].astype(bool),
    cliprange_value=eps,
    agg='seq_mean_token_mean',
  )
  _close(loss, out['loss'])
  _close(met['critic/vf_loss'], out['loss'])
  _close(met['critic/vf_clipfrac'], out['clipfrac'] or 0.0)


# ================================================================== slime

SLIME = gd.load('slime')


def _slime_layout():
  """Packed e2e arrays -> padded [B, T] gather indices and masks."""
  tl = SLIME.array('inputs/e2e_total_lengths')
  rl = SLIME.array('inputs/e2e_response_lengths')
  tok = SLIME.array('inputs/e2e_tokens')
  starts = np.concatenate([[0], np.cumsum(tl)[:-1]])
  b, t = len(rl), int(rl.max())
  pos = np.zeros((b, t), np.int32)
  tgt = np.zeros((b, t), np.int32)
  valid = np.zeros((b, t), bool)
  for i, (s, n, r) in enumerate(zip(starts, tl, rl)):
    pos[i, :r] = np.arange(s + n - r - 1, s + n - 1)  # logits predict t+1
    tgt[i, :r] = tok[s + n - r : s + n]
    valid[i, :r] = True

  def pad(flat):
    out = np.zeros((b, t), np.float32)
    out[valid] = flat
    return out

  return pos, tgt, valid, pad


def _slime_logp_entropy(logits, pos, tgt, temperature):
  lsm = jax.nn.log_softmax(logits[pos] / temperature, axis=-1)
  logp = jnp.take_along_axis(lsm, tgt[..., None], axis=-1)[..., 0]
  entropy = -jnp.sum(jnp.exp(lsm) * lsm, axis=-1)
  return logp, entropy


SLIME_CORR = {
  'tis_vanilla': dict(is_level='token', is_mode='truncate', is_upper=2.0),
  'tis_icepop_0.5_2': dict(
    is_level='token', is_mode='mask', is_lower=0.5, is_upper=2.0
  ),
  'mis_geometric_mask': dict(
    is_level='geometric', is_mode='mask', is_lower=0.9, is_upper=1.1
  ),
  'mismatch_metrics_only': {},  # the `disabled` preset: metrics only
  'mis_yaml_default': dict(
    is_level='token',
    is_mode='truncate',
    is_lower=0.5,
    is_upper=2.0,
    rs='token_k1',
    rs_bounds='0.5_2.0',
    veto_low=1e-4,
    is_batch_normalize=True,
  ),
}
SLIME_SKIP = {
  'kl_loss_k3_unbiased': 'DeepSeek-V3.2 "unbiased" KL (k3 weighted by '
  'π_θ/π_old) is not an objective option in jaxcorr',
  'opsm': 'OPSM (off-policy sequence masking) is not part of jaxcorr',
}


def _slime_run(case_id):
  case = SLIME.case(case_id)
  a = SLIME.kwargs(case)['args']
  pos, tgt, _, pad = _slime_layout()
  mask = pad(SLIME.array('inputs/flat_loss_mask')).astype(bool)
  adv = pad(SLIME.array('inputs/flat_adv_tok'))
  old = pad(SLIME.array('inputs/e2e_old_logprobs'))
  ro = pad(SLIME.array('inputs/e2e_rollout_logprobs'))
  ref = pad(SLIME.array('inputs/e2e_ref_logprobs'))
  name = {'grpo': 'vanilla', 'gspo': 'gspo_seq', 'cispo': 'cispo'}[
    a['advantage_estimator']
  ]
  if name == 'cispo':
    knobs = dict(
      cispo_clip_low=a['eps_clip'], cispo_clip_high=a['eps_clip_high']
    )
  else:
    knobs = dict(
      clip_ratio_low=a['eps_clip'],
      clip_ratio_high=a['eps_clip_high'],
      clip_ratio_c=a['eps_clip_c'],
    )
  # slime's loss is Σ over samples of the per-sample token mean: that is
  # seq_mean_token_mean with num_seqs=1 (or token_sum per token).
  per_token = a['calculate_per_token_loss']
  actor = obj.ActorLossConfig(
    policy_loss=name,
    agg='token_sum' if per_token else 'seq_mean_token_mean',
    entropy_coeff=a['entropy_coef'],
    kl_loss_type=a['kl_loss_type'],
    kl_loss_coef=a['kl_loss_coef'] if a['use_kl_loss'] else 0.0,
    **knobs,
  )
  short = case_id.split('/')[1]
  args = dict(advantages=adv, mask=mask, ref_logp=ref, num_seqs=1.0)
  if a['use_rollout_logprobs']:  # old := rollout: bypass + ppo_clip
    cc = corr_lib.CorrectionConfig(mode='bypass')
    args.update(rollout_logp=ro)
  elif short in SLIME_CORR:
    cc = corr_lib.CorrectionConfig(**SLIME_CORR[short])
    corr = corr_lib.rollout_correction(old, ro, mask, cc)
    args.update(old_logp=old, correction=corr)
  else:
    cc = None
    args.update(old_logp=old)

  def f(logits):
    logp, ent = _slime_logp_entropy(logits, pos, tgt, a['rollout_temperature'])
    return obj.actor_objective(actor, cc, logp=logp, entropy=ent, **args)

  logits = SLIME.array('inputs/e2e_logits')[0]
  (loss, met), grad = jax.value_and_grad(f, has_aux=True)(logits)
  return case, SLIME.outputs(case), loss, met, np.asarray(grad), args


@pytest.mark.parametrize(
  'case',
  [
    c
    for c in gd.case_params('slime', group='e2e')
    if c.values[0]['id'] != 'e2e/mis_yaml_default'
  ],
)
def test_slime_e2e(case):
  short = case['id'].split('/')[1]
  if short in SLIME_SKIP:
    pytest.skip(SLIME_SKIP[short])
  _, out, loss, met, grad, _ = _slime_run(case['id'])
  _close(loss, out['loss'])
  _close(grad, out['grad_logits'][0])
  _close(met['actor/pg_loss'], out['reported/pg_loss'])
  if 'reported/kl_loss' in out:
    _close(met['actor/kl_loss'], out['reported/kl_loss'])
  if short != 'mis_geometric_mask':
    # slime's mask mode removes out-of-band tokens from the mask, so they
    # leave its entropy; jaxcorr keeps them there (verl,
    # docs/math/correction.md §4.3).
    _close(met['actor/entropy'], out['reported/entropy_loss'], rtol=2e-6)


@pytest.mark.golden('slime')
def test_slime_e2e_mis_d5_divergence():
  """slime's MIS divides each sample by its pre-rejection token count.

  Rejected tokens leave slime's loss mask but not `rollout_mask_sums`, so
  their sample's mean is taken over the original length. jaxcorr takes it
  over the corrected mask (D5). Both values are derived from the same
  per-token losses below.
  """
  _, out, loss, met, _, args = _slime_run('e2e/mis_yaml_default')
  corr, mask = args['correction'], args['mask']
  assert (mask & ~np.asarray(corr.mask)).sum() > 0  # some tokens rejected
  pos, tgt, _, _ = _slime_layout()
  logits = SLIME.array('inputs/e2e_logits')[0]
  logp, ent = _slime_logp_entropy(logits, pos, tgt, 1.0)
  per_tok = []
  for i in range(mask.shape[0]):  # per-row token sums through policy_loss
    row = np.zeros_like(mask)
    row[i] = np.asarray(corr.mask)[i]
    per_tok.append(
      pol.policy_loss(
        'vanilla',
        logp,
        args['old_logp'],
        args['advantages'],
        jnp.asarray(row),
        is_weights=corr.weights,
        agg='token_sum',
        knobs=pol.PolicyKnobs(
          clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None
        ),
      )[0]
    )
  sums = np.asarray(per_tok, np.float64)
  pre = SLIME.array('e2e/mis_yaml_default/in/rollout_mask_sums')
  post = np.asarray(corr.mask).sum(-1)
  np.testing.assert_array_equal(pre, mask.sum(-1))
  _close(np.sum(sums / pre), out['loss'])  # slime: pre-rejection counts
  _close(loss, np.sum(sums / post))  # jaxcorr: corrected counts
  assert abs(float(loss) - out['loss']) > 1e-3
  ent_rows = np.sum(np.where(corr.mask, ent, 0), -1)
  _close(np.sum(ent_rows / pre), out['reported/entropy_loss'])
  _close(met['actor/entropy'], np.sum(ent_rows / post))


# ================================================================ prime-rl

PRIME = gd.load('prime')
PRIME_SKIP = {
  'head/compute_loss/default/rl_weights_ce_refkl': 'per-token rl/ce/ref-KL '
  'component weights and scales are prime-rl trainer features, not part of '
  'the jaxcorr objective',
  'head/compute_loss/ipo/rl_only': "prime-rl's IPO loss is not in the "
  'jaxcorr registry',
  'head/compute_loss/ipo/rl_weights_ce_refkl': "prime-rl's IPO loss is not "
  'in the jaxcorr registry',
}


def _prime_inputs(case):
  kw = PRIME.kwargs(case)
  return (
    kw,
    kw['trainer_logprobs'][None],
    kw['inference_logprobs'][None],
    kw['advantages'][None],
    kw['loss_mask'][None].astype(bool),
  )


@pytest.mark.parametrize(
  'case', gd.case_params('prime', group='head/compute_loss')
)
def test_prime_compute_loss(case):
  """prime_dppo_kl preset (bypass + prime, token_mean) == prime-rl."""
  if case['id'] in PRIME_SKIP:
    pytest.skip(PRIME_SKIP[case['id']])
  kw, lp, ro, adv, mask = _prime_inputs(case)
  assert kw['rl_scale'] == mask.sum()  # global token count = token_mean
  actor, cc = _preset('prime_dppo_kl')
  lc = kw['loss_config']
  actor = dataclasses.replace(
    actor,
    prime_mask_low=lc['dppo_mask_low'],
    prime_mask_high=lc['dppo_mask_high'],
    prime_adv_tau=lc['adv_tau'],
    prime_kl_tau=lc['kl_tau'],
  )
  loss, met, grad = _grad_logp(
    actor, cc, lp, jit=True, advantages=adv, mask=mask, rollout_logp=ro
  )
  out = PRIME.outputs(case)
  _close(loss, out['loss'])
  _close(grad[0], out['grad_trainer_logprobs'])
  # Per-sample metrics, token-weighted, are jaxcorr's pooled ones.
  sizes = np.diff(
    np.concatenate([[0], np.cumsum(PRIME.array('inputs/lengths'))])
  )
  rows = np.split(mask[0], np.cumsum(sizes)[:-1])
  n_i = np.array([r.sum() for r in rows])
  pooled = np.sum(out['metric/is_masked'] * n_i) / n_i.sum()
  _close(met['actor/prime_is_masked'], pooled)


@pytest.mark.golden('prime')
def test_prime_kl_tau_is_rollout_kl():
  """docs/math/losses.md §6: `prime` with τ_KL = 0 plus `+rollout_kl` (k2, 2e-3)
  == prime-rl."""
  case = PRIME.case('head/compute_loss/default/rl_only')
  _, lp, ro, adv, mask = _prime_inputs(case)
  actor, cc = _preset('prime_dppo_kl+rollout_kl')
  actor = dataclasses.replace(actor, prime_kl_tau=0.0)
  assert actor.rollout_kl_coef == 2 * 1e-3 and actor.rollout_kl_type == 'k2'
  loss, met, grad = _grad_logp(
    actor, cc, lp, jit=True, advantages=adv, mask=mask, rollout_logp=ro
  )
  out = PRIME.outputs(case)
  _close(loss, out['loss'])
  _close(grad[0], out['grad_trainer_logprobs'])
  assert float(met['actor/rollout_kl_loss']) > 0


# ======================================================= synthetic batches


def _batch(seed=0, b=8, t=12, shift_rows=(2, 5)):
  """Random batch with an empty row, a hole, and two badly mismatched rows."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(2, t + 1, size=b)
  lengths[0], lengths[3] = t, 0
  mask = np.arange(t)[None] < lengths[:, None]
  mask[1, 1:3] = False
  f32 = np.float32
  old = -np.abs(rng.normal(1.0, 0.5, (b, t))).astype(f32)
  ro = old + rng.normal(0, 0.05, (b, t)).astype(f32)
  ro[list(shift_rows)] -= 0.6
  return dict(
    logp=old + rng.normal(0, 0.1, (b, t)).astype(f32),
    old_logp=old,
    rollout_logp=ro,
    ref_logp=old + rng.normal(0, 0.1, (b, t)).astype(f32),
    advantages=rng.normal(size=(b, t)).astype(f32),
    entropy=rng.uniform(0.5, 2.0, (b, t)).astype(f32),
    mask=mask,
  )


RS_DECOUPLED = corr_lib.CorrectionConfig(
  is_level='token', rs='seq_mean_k3', rs_bounds=0.01
)
RS_BYPASS = corr_lib.CorrectionConfig(
  mode='bypass',
  bypass_loss='reinforce',
  is_level='token',
  rs='seq_mean_k3',
  rs_bounds=0.01,
)
ALL_TERMS = dict(entropy_coeff=0.01, kl_loss_coef=0.1, rollout_kl_coef=0.05)


def _slice(d, s):
  return {k: v[s] for k, v in d.items()}


def _run(actor, cc, data, correction=None, **kw):
  """value, metrics, grad(logp) of the objective on a data dict."""
  d = dict(data)
  logp = d.pop('logp')
  if cc is not None and cc.mode == 'bypass':
    d.pop('old_logp', None)
  elif cc is not None and correction is None:
    correction = corr_lib.rollout_correction(
      d['old_logp'], d['rollout_logp'], d['mask'], cc
    )
  return _grad_logp(actor, cc, logp, correction=correction, **d, **kw)


MICRO = (slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8))


@pytest.mark.parametrize(
  'mode', ['token_mean', 'token_sum', 'seq_mean_token_sum_norm', None]
)
def test_micro_batches_with_global_normalizers_decoupled(mode):
  """Decoupled: counts of the corrected mini-batch mask, split in 4."""
  data = _batch()
  name = 'gspo' if mode is None else 'vanilla'  # None: mixed divisors
  actor = obj.ActorLossConfig(policy_loss=name, agg=mode, **ALL_TERMS)
  cc = RS_DECOUPLED
  rest = {k: v for k, v in data.items() if k != 'logp'}

  @jax.jit
  def both(lp):
    corr = corr_lib.rollout_correction(
      rest['old_logp'], rest['rollout_logp'], rest['mask'], cc
    )

    def full(x):
      return obj.actor_objective(
        actor, cc, logp=x, correction=corr, norm=16.0, **rest
      )[0]

    n_tok, n_seq = obj.loss_normalizers(corr.mask)

    def split(x):
      total = 0.0
      for s in MICRO:
        part = corr_lib.Correction(corr.weights[s], corr.mask[s], corr.metrics)
        total += obj.actor_objective(
          actor,
          cc,
          logp=x[s],
          correction=part,
          num_tokens=n_tok,
          num_seqs=n_seq,
          norm=16.0,
          **_slice(rest, s),
        )[0]
      return total

    kept = jnp.sum(jnp.any(corr.mask, -1))
    return jax.value_and_grad(full)(lp), jax.value_and_grad(split)(lp), kept

  (v0, g0), (v1, g1), kept = both(jnp.asarray(data['logp']))
  assert 0 < kept < data['mask'].any(-1).sum()  # RS rejected rows
  _close(v1, v0, rtol=1e-6, atol=1e-7)
  _close(g1, g0, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
  'mode', ['token_mean', 'token_sum', 'seq_mean_token_sum_norm']
)
def test_micro_batches_bypass_rejection_aggregate_terms(mode):
  """Bypass + RS: unit normalisers, accumulate, divide once (aggregate_terms).

  The mask depends on π_θ, so each micro-batch's count is only known after
  its forward pass: every call uses num_tokens = num_seqs = 1, which makes
  each term its `aggregate_terms` numerator; the counts come back in the
  metrics; the sums are divided once at the end.
  """
  data = _batch(seed=1)
  actor = obj.ActorLossConfig(policy_loss='reinforce', agg=mode, **ALL_TERMS)
  cc = RS_BYPASS
  kind = obj.normalizer_kind(actor)
  assert kind == {'token_sum': 'none', 'token_mean': 'tokens'}.get(mode, 'seqs')
  key = 'actor/loss_seq_count' if kind == 'seqs' else 'actor/loss_token_count'
  rest = {k: v for k, v in data.items() if k not in ('logp', 'old_logp')}

  @jax.jit
  def full(lp):
    def f(x):
      return obj.actor_objective(actor, cc, logp=x, norm=16.0, **rest)

    return jax.value_and_grad(f, has_aux=True)(lp)

  @jax.jit
  def unit(lp, part):
    def f(x):
      return obj.actor_objective(
        actor, cc, logp=x, num_tokens=1, num_seqs=1, norm=16.0, **part
      )

    (v, met), g = jax.value_and_grad(f, has_aux=True)(lp)
    # aggregate_terms' count on this micro-batch's corrected mask.
    corr = corr_lib.rollout_correction(
      lp, part['rollout_logp'], part['mask'], cc
    )
    _, cnt = agg_lib.aggregate_terms(
      jnp.zeros(corr.mask.shape), corr.mask, mode
    )
    return v, met[key], g, cnt

  (v_full, met_full), g_full = full(jnp.asarray(data['logp']))
  assert 0 < met_full['actor/loss_seq_count'] < data['mask'].any(-1).sum()
  num, cnt, grads = 0.0, 0.0, []
  for s in MICRO:
    v, c, g, want_c = unit(jnp.asarray(data['logp'][s]), _slice(rest, s))
    if kind != 'none':
      assert float(c) == float(want_c)
    num, cnt = num + v, cnt + c
    grads.append(g)
  grad = jnp.concatenate(grads)
  _close(agg_lib.finalize(num, cnt, mode), v_full, rtol=1e-6, atol=1e-7)
  _close(grad if kind == 'none' else grad / cnt, g_full, rtol=1e-6, atol=1e-7)


def test_normalizer_kind():
  kind = obj.normalizer_kind
  assert kind(obj.ActorLossConfig()) == 'tokens'
  assert kind(obj.ActorLossConfig(policy_loss='gspo')) == 'seqs'
  assert kind(obj.ActorLossConfig(policy_loss='gspo', kl_loss_coef=0.1)) == (
    'mixed'
  )
  assert kind(obj.ActorLossConfig(policy_loss='gspo', entropy_coeff=0.1)) == (
    'mixed'
  )
  assert kind(obj.ActorLossConfig(rollout_kl_coef=0.1)) == 'tokens'
  cfg = obj.ActorLossConfig(policy_loss='gspo', agg='token_sum', kl_loss_coef=1)
  assert kind(cfg) == 'none'


def test_loss_normalizers_count_corrected_mask():
  mask = np.array([[1, 1, 0], [0, 0, 0], [0, 1, 0]], bool)
  n_tok, n_seq = obj.loss_normalizers(mask)
  assert float(n_tok) == 3.0 and float(n_seq) == 2.0
  with pytest.raises(ValueError, match='bool'):
    obj.loss_normalizers(mask.astype(np.float32))


# ------------------------------------------------------------ reduces-to


DECOUPLED_PRESETS = [
  n
  for n in presets.PRESETS
  if presets.PRESETS[n].get('correction.mode') == 'decoupled'
]


@pytest.mark.parametrize(
  'preset', DECOUPLED_PRESETS, ids=lambda n: f'preset={n}'
)
def test_decoupled_identical_logps_is_plain_ppo(preset):
  """μ = π_old: weights 1, nothing rejected -> exactly the uncorrected loss."""
  data = _batch(seed=2)
  data['rollout_logp'] = data['old_logp']
  actor, cc = _preset(preset)
  actor = dataclasses.replace(actor, **ALL_TERMS)
  v1, m1, g1 = _run(actor, cc, data)
  v0, m0, g0 = _run(actor, None, data)
  assert float(m1['actor/loss_token_count']) == data['mask'].sum()
  np.testing.assert_array_equal(v1, v0)
  np.testing.assert_array_equal(g1, g0)
  for k in m0:
    np.testing.assert_array_equal(m1[k], m0[k])


@pytest.mark.parametrize(
  'bypass,decoupled',
  [('bypass_ppo_clip', 'disabled'), ('bypass_ppo_clip', 'decoupled_token_is')],
)
def test_bypass_equals_decoupled_when_old_is_rollout(bypass, decoupled):
  data = _batch(seed=3)
  data['rollout_logp'] = data['old_logp']
  a_b, c_b = _preset(bypass + '+rollout_kl')
  a_d, c_d = _preset(decoupled + '+rollout_kl')
  if decoupled == 'decoupled_token_is':  # IS in bypass ppo_clip: metrics only
    c_b = dataclasses.replace(c_b, is_level='token')
  v_b, _, g_b = _run(a_b, c_b, data)
  v_d, _, g_d = _run(a_d, c_d, data)
  _close(v_b, v_d, rtol=1e-6, atol=0)
  _close(g_b, g_d, rtol=1e-6, atol=1e-9)


def test_bypass_weights_only_for_reinforce():
  """ppo_clip: IS weights are metrics only; reinforce: they scale pg."""
  data = _batch(seed=4)
  vanilla = obj.ActorLossConfig()
  no_is = corr_lib.CorrectionConfig(mode='bypass')
  with_is = dataclasses.replace(no_is, is_level='token')
  v0, _, _ = _run(vanilla, no_is, data)
  v1, m1, _ = _run(vanilla, with_is, data)
  np.testing.assert_array_equal(v0, v1)
  assert 'rollout_corr/rollout_is_mean' in m1
  reinforce = obj.ActorLossConfig(policy_loss='reinforce')
  pg = dict(mode='bypass', bypass_loss='reinforce')
  r0, _, _ = _run(reinforce, corr_lib.CorrectionConfig(**pg), data)
  r1, _, _ = _run(
    reinforce, corr_lib.CorrectionConfig(is_level='token', **pg), data
  )
  assert abs(float(r0) - float(r1)) > 1e-4
  # With no IS, bypass reinforce is REINFORCE (= gpg) on the same mask.
  gpg, _, _ = _run(obj.ActorLossConfig(policy_loss='gpg'), None, data)
  _close(r0, gpg)


# -------------------------------------------------------- JAX contracts


def _contract_setups():
  return {
    'none': (obj.ActorLossConfig(**ALL_TERMS), None),
    'decoupled': (obj.ActorLossConfig(**ALL_TERMS), RS_DECOUPLED),
    'bypass': (
      obj.ActorLossConfig(policy_loss='reinforce', **ALL_TERMS),
      RS_BYPASS,
    ),
  }


@pytest.mark.parametrize('setup', ['none', 'decoupled', 'bypass'])
def test_gradient_of_constants_is_exactly_zero(setup):
  actor, cc = _contract_setups()[setup]
  data = _batch(seed=5)
  names = ['old_logp', 'rollout_logp', 'ref_logp', 'advantages']
  if setup == 'bypass':
    names.remove('old_logp')

  def f(*consts):
    d = dict(data, **dict(zip(names, consts)))
    d.pop('logp')
    if setup == 'bypass':
      d.pop('old_logp')
    elif setup == 'decoupled':  # the correction is part of the pipeline
      d['correction'] = corr_lib.rollout_correction(
        d['old_logp'], d['rollout_logp'], d['mask'], cc
      )
    return obj.actor_objective(actor, cc, logp=data['logp'], **d)[0]

  grads = jax.grad(f, argnums=tuple(range(len(names))))(
    *(jnp.asarray(data[n]) for n in names)
  )
  for n, g in zip(names, grads):
    assert not np.any(np.asarray(g)), n
  # ... while logp and entropy do carry gradient.
  _, _, g = _run(actor, cc, data)
  assert np.any(g)


@pytest.mark.parametrize('setup', ['none', 'decoupled', 'bypass'])
def test_nan_in_padding_is_bitwise_invariant(setup):
  actor, cc = _contract_setups()[setup]
  clean = _batch(seed=6)
  dirty = dict(clean)
  pad = ~clean['mask']
  junk = np.where(np.arange(pad.size).reshape(pad.shape) % 3, np.nan, np.inf)
  for k in ('logp', 'old_logp', 'rollout_logp', 'ref_logp', 'advantages'):
    dirty[k] = np.where(pad, junk, clean[k]).astype(np.float32)
  dirty['entropy'] = np.where(pad, -np.inf, clean['entropy']).astype(np.float32)

  def run(d):
    d = dict(d)
    lp, ent = d.pop('logp'), d.pop('entropy')
    if cc is not None and cc.mode == 'bypass':
      d.pop('old_logp')
    elif cc is not None:
      d['correction'] = corr_lib.rollout_correction(
        d['old_logp'], d['rollout_logp'], d['mask'], cc
      )

    def f(x, e):
      return obj.actor_objective(actor, cc, logp=x, entropy=e, **d)

    return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(lp, ent)

  (v1, m1), g1 = run(clean)
  (v2, m2), g2 = run(dirty)
  assert np.asarray(v1).tobytes() == np.asarray(v2).tobytes()
  for a, b in zip(g1, g2):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  assert m1.keys() == m2.keys()
  for k in m1:
    assert np.asarray(m1[k]).tobytes() == np.asarray(m2[k]).tobytes(), k


def _jitted(actor, cc):
  """value_and_grad of the whole step; decoupled runs its correction first."""

  def f(data):
    d = dict(data)
    lp = d.pop('logp')
    if cc is not None and cc.mode == 'bypass':
      d.pop('old_logp')
    elif cc is not None and 'correction' not in d:
      d['correction'] = corr_lib.rollout_correction(
        d['old_logp'], d['rollout_logp'], d['mask'], cc
      )

    def loss(x):
      return obj.actor_objective(actor, cc, logp=x, **d)

    return jax.value_and_grad(loss, has_aux=True)(lp)

  return f


@pytest.mark.parametrize('setup', ['decoupled', 'bypass'])
def test_jit_equals_eager(setup):
  actor, cc = _contract_setups()[setup]
  data = _batch(seed=7)
  if setup == 'decoupled':
    data['correction'] = corr_lib.rollout_correction(
      data['old_logp'], data['rollout_logp'], data['mask'], cc
    )
  f = _jitted(actor, cc)
  (v0, m0), g0 = f(data)
  (v1, m1), g1 = jax.jit(f)(data)
  _close(v1, v0, rtol=1e-6, atol=1e-7)
  _close(g1, g0, rtol=1e-6, atol=1e-8)
  assert m0.keys() == m1.keys()
  for k in m0:
    _close(m1[k], m0[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize('setup', ['decoupled', 'bypass'])
def test_sharded_over_8_devices_equals_single_device(setup):
  devices = jax.devices()
  assert len(devices) == 8
  actor, cc = _contract_setups()[setup]
  data = _batch(seed=8)  # one row per device; correction inside the jit
  mesh = jax.sharding.Mesh(np.array(devices), ('data',))
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def put(x):
    x = jnp.asarray(x)
    return jax.device_put(x, spec if x.ndim == 2 else rep)

  f = jax.jit(_jitted(actor, cc))
  (v0, m0), g0 = f(jax.device_put(data, devices[0]))
  sharded = jax.tree.map(put, data)
  assert len(sharded['logp'].sharding.device_set) == 8
  (v1, m1), g1 = f(sharded)
  _close(v1, v0, rtol=1e-6, atol=1e-7)
  _close(g1, g0, rtol=1e-6, atol=1e-8)
  for k in m0:
    _close(m1[k], m0[k], **MET_TOL)


@pytest.mark.parametrize('setup', ['none', 'decoupled', 'bypass'])
def test_all_masked_is_exact_zero(setup):
  actor, cc = _contract_setups()[setup]
  data = _batch(seed=9)
  data['mask'] = np.zeros_like(data['mask'])
  for agg in MODES:
    a = dataclasses.replace(actor, agg=agg)
    v, met, g = _run(a, cc, data)
    assert float(v) == 0.0 and not np.any(g), agg
    assert all(np.isfinite(np.asarray(x)) for x in met.values())


def test_extreme_log_ratios_are_finite():
  data = _batch(seed=10)
  data['logp'] = data['old_logp'] + np.float32(30.0)
  data['logp'][1, :4] = data['old_logp'][1, :4] - 30.0
  for setup in ('decoupled', 'bypass'):
    actor, cc = _contract_setups()[setup]
    v, _, g = _run(actor, cc, data)
    assert np.isfinite(np.asarray(v)) and np.all(np.isfinite(g))


# ------------------------------------------------------ metrics and errors


def test_metric_keys_depend_only_on_config():
  data = _batch(seed=11)
  actor = obj.ActorLossConfig(**ALL_TERMS)
  _, met, _ = _run(actor, None, data)
  assert set(met) == {
    'actor/pg_loss',
    'actor/entropy',
    'actor/kl_loss',
    'actor/kl_coef',
    'actor/rollout_kl_loss',
    'actor/rollout_kl_coef',
    'actor/loss_token_count',
    'actor/loss_seq_count',
    'actor/pg_clipfrac',
    'actor/pg_clipfrac_lower',
    'actor/ppo_kl',
  }
  d = {k: v for k, v in data.items() if k != 'entropy'}
  _, met, _ = _run(obj.ActorLossConfig(), None, d)
  assert 'actor/entropy' not in met and 'actor/kl_loss' not in met
  assert 'actor/rollout_kl_loss' not in met
  # Bypass merges the correction's metrics; decoupled does not (the trainer
  # logs the once-per-batch correction metrics itself).
  _, met_b, _ = _run(actor, corr_lib.CorrectionConfig(mode='bypass'), data)
  assert any(k.startswith('rollout_corr/') for k in met_b)
  _, met_d, _ = _run(actor, corr_lib.CorrectionConfig(), data)
  assert not any(k.startswith('rollout_corr/') for k in met_d)
  # The same config on other data gives the same keys.
  _, met_b2, _ = _run(
    actor, corr_lib.CorrectionConfig(mode='bypass'), _batch(seed=12)
  )
  assert set(met_b) == set(met_b2)


def test_counts_and_terms_on_corrected_mask():
  """D5: rejected tokens leave every term and both counts."""
  data = _batch(seed=13)
  actor = obj.ActorLossConfig(**ALL_TERMS)
  cc = RS_DECOUPLED
  corr = corr_lib.rollout_correction(
    data['old_logp'], data['rollout_logp'], data['mask'], cc
  )
  _, met, g = _run(actor, cc, data, correction=corr)
  m = np.asarray(corr.mask)
  assert float(met['actor/loss_token_count']) == m.sum()
  assert float(met['actor/loss_seq_count']) == m.any(-1).sum()
  ent = np.where(m, data['entropy'], 0).sum() / m.sum()
  _close(met['actor/entropy'], ent)
  assert not np.any(g[data['mask'] & ~m])


def _errors_data():
  return _batch(seed=14)


def test_mode_mixups_are_errors():
  d = _errors_data()
  actor = obj.ActorLossConfig()
  lp = d.pop('logp')
  bypass = corr_lib.CorrectionConfig(mode='bypass')
  dec = corr_lib.CorrectionConfig()
  corr = corr_lib.rollout_correction(
    d['old_logp'], d['rollout_logp'], d['mask'], dec
  )
  with pytest.raises(ValueError, match='old_logp must be None in bypass'):
    obj.actor_objective(actor, bypass, logp=lp, **d)
  no_old = {k: v for k, v in d.items() if k != 'old_logp'}
  with pytest.raises(ValueError, match='correction must be None in bypass'):
    obj.actor_objective(actor, bypass, logp=lp, correction=corr, **no_old)
  with pytest.raises(ValueError, match='correction is required in decoupled'):
    obj.actor_objective(actor, dec, logp=lp, **d)
  with pytest.raises(ValueError, match='corr_cfg is None'):
    obj.actor_objective(actor, None, logp=lp, correction=corr, **d)
  no_ro = {k: v for k, v in no_old.items() if k != 'rollout_logp'}
  with pytest.raises(ValueError, match='rollout_logp is required'):
    obj.actor_objective(actor, bypass, logp=lp, **no_ro)


@pytest.mark.parametrize(
  'cfg_kw,drop,match',
  [
    ({}, 'old_logp', 'old_logp is required'),
    ({'entropy_coeff': 0.1}, 'entropy', 'entropy is required'),
    ({'kl_loss_coef': 0.1}, 'ref_logp', 'ref_logp is required'),
    ({'rollout_kl_coef': 0.1}, 'rollout_logp', 'rollout_logp is required'),
    ({'policy_loss': 'prime'}, 'rollout_logp', 'rollout_logp is required'),
  ],
)
def test_missing_arrays_are_errors(cfg_kw, drop, match):
  d = _errors_data()
  lp = d.pop('logp')
  d.pop(drop)
  with pytest.raises(ValueError, match=match):
    obj.actor_objective(obj.ActorLossConfig(**cfg_kw), None, logp=lp, **d)


def test_trace_time_shape_and_dtype_errors():
  d = _errors_data()
  lp = d.pop('logp')
  actor = obj.ActorLossConfig()
  with pytest.raises(ValueError, match='bool'):
    obj.actor_objective(
      actor, None, logp=lp, **dict(d, mask=d['mask'].astype(np.float32))
    )
  with pytest.raises(ValueError, match='shape mismatch'):
    obj.actor_objective(
      actor, None, logp=lp, **dict(d, entropy=d['entropy'][:, :3])
    )


def test_objective_checks_combinations_at_trace_time():
  d = _errors_data()
  lp = d.pop('logp')
  d.pop('old_logp')
  pg = corr_lib.CorrectionConfig(mode='bypass', bypass_loss='reinforce')
  with pytest.raises(ValueError, match="policy_loss='vanilla' is not allowed"):
    obj.actor_objective(obj.ActorLossConfig(), pg, logp=lp, **d)


def test_compatibility_is_checked_once_per_config_pair():
  """A valid (actor, correction) pair is checked when first seen; every later
  trace with it is a cache hit, not a re-check."""
  d = _errors_data()
  lp = d.pop('logp')
  actor = obj.ActorLossConfig(clip_ratio_low=0.123)  # a pair not seen yet
  loss = jax.jit(
    lambda x, arrays: obj.actor_objective(actor, None, logp=x, **arrays)[0]
  )
  before = obj.check_compatible.cache_info()
  for n in (2, 3):  # two traces: different batch sizes
    loss(lp[:n], {k: v[:n] for k, v in d.items()})
  after = obj.check_compatible.cache_info()
  assert after.misses == before.misses + 1
  assert after.hits >= before.hits + 1


# ----------------------------------------------------- ActorLossConfig


def test_actor_config_knobs_match_policy_registry():
  knobs = {f.name for f in dataclasses.fields(pol.PolicyKnobs)}
  assert set(obj.KNOB_FIELDS) == knobs
  cfg = obj.ActorLossConfig()
  for k in knobs:
    assert getattr(cfg, k) == getattr(pol.DEFAULT_KNOBS, k), k
  assert cfg.knobs == pol.DEFAULT_KNOBS
  assert (cfg.entropy_coeff, cfg.kl_loss_coef, cfg.rollout_kl_coef) == (0, 0, 0)
  assert cfg.policy_loss == 'vanilla' and cfg.agg is None


def test_actor_config_is_hashable_and_canonical():
  a = obj.ActorLossConfig(agg='seq-mean-token-mean', kl_loss_type='low_var_kl')
  b = obj.ActorLossConfig(agg='seq_mean_token_mean', kl_loss_type='k3')
  assert a == b and hash(a) == hash(b)
  assert a.agg == 'seq_mean_token_mean' and a.kl_loss_type == 'k3'
  assert obj.ActorLossConfig(rollout_kl_type='mse+').rollout_kl_type == 'k2+'
  jax.jit(lambda x, c: x, static_argnums=1)(1.0, a)  # usable as static arg


@pytest.mark.parametrize(
  'kw,match',
  [
    ({'policy_loss': 'ppo'}, r"policy_loss='ppo'.*allowed: cispo"),
    ({'agg': 'mean'}, r"agg='mean'.*allowed: token_mean"),
    ({'kl_loss_type': 'full'}, r"kl_loss_type='full'.*allowed: k1"),
    ({'rollout_kl_type': 'k4'}, r"rollout_kl_type='k4'.*allowed: k1"),
    ({'clip_ratio_c': 1.0}, r'clip_ratio_c=1.0.*allowed: a number > 1'),
    ({'policy_loss': 'dro'}, r'dro_beta=None.*allowed: a number > 0'),
    ({'kl_loss_coef': -0.1}, r'kl_loss_coef=-0.1.*allowed: a finite number'),
    ({'rollout_kl_coef': True}, r'rollout_kl_coef=True.*allowed'),
    ({'entropy_coeff': math.nan}, r'entropy_coeff=nan.*allowed'),
    ({'clip_cov_lb': 6.0}, r'clip_cov_lb.*allowed: clip_cov_lb < clip_cov_ub'),
  ],
)
def test_actor_config_validation(kw, match):
  with pytest.raises(ValueError, match=match):
    obj.ActorLossConfig(**kw)


def test_check_compatible_rules():
  cc = corr_lib.CorrectionConfig
  check = obj.check_compatible
  a = obj.ActorLossConfig
  with pytest.raises(ValueError, match=r"policy_loss='reinforce'.*allowed:"):
    check(a(policy_loss='reinforce'), cc(mode='bypass'))
  with pytest.raises(ValueError, match=r'allowed: reinforce$'):
    check(a(policy_loss='gpg'), cc(mode='bypass', bypass_loss='reinforce'))
  mu_anchored = [n for n, uses in pol.USES_IS_WEIGHTS.items() if not uses]
  assert {'rollout_is', 'prime'} <= set(mu_anchored)
  for name in mu_anchored:
    with pytest.raises(ValueError, match=r"is_level='token'.*is_level=None"):
      check(a(policy_loss=name), cc(is_level='token'))
    check(a(policy_loss=name), cc(mode='bypass'))
  with pytest.raises(ValueError, match='does not report log-probs'):
    check(a(), cc(), rollout_logp_available=False)
  with pytest.raises(ValueError, match=r'rollout_kl_coef=0\.1 needs rollout'):
    check(a(rollout_kl_coef=0.1), None, rollout_logp_available=False)
  with pytest.raises(ValueError, match=r"'rollout_is' reads rollout"):
    check(a(policy_loss='rollout_is'), None, rollout_logp_available=False)
  check(a(), None, rollout_logp_available=False)
  for name in pol.LOSSES:  # decoupled takes any loss
    if name not in (*mu_anchored, 'dro'):
      check(a(policy_loss=name), cc(is_level='token'))
  # Decision: bypass reinforce with no IS, RS or veto is plain REINFORCE.
  check(a(policy_loss='reinforce'), cc(mode='bypass', bypass_loss='reinforce'))


# ------------------------------------------------------------ value loss


def test_value_loss_formula_by_hand():
  v = np.array([[1.0, 2.0, 3.0, 9.0]], np.float32)
  v_old = np.array([[1.2, 1.0, 3.1, 0.0]], np.float32)
  ret = np.array([[0.5, 2.5, 3.0, 0.0]], np.float32)
  mask = np.array([[True, True, True, False]])
  loss, met = val.value_loss(v, v_old, ret, mask, cliprange_value=0.5)
  # token 0: unclipped (0.5)²=0.25, clipped v̂=1.0 -> 0.25: 0.25 (no clip)
  # token 1: unclipped 0.25, v̂=1.5 -> 1.0: clipped wins
  # token 2: unclipped 0, v̂=3.0 -> 0: 0
  _close(loss, 0.5 * (0.25 + 1.0 + 0.0) / 3)
  _close(met['critic/vf_clipfrac'], 1 / 3)
  _close(met['critic/vpred_mean'], 2.0)
  g = jax.grad(lambda x: val.value_loss(x, v_old, ret, mask)[0])(v)
  # token 1's max branch is the clipped one, whose clip is active: grad 0.
  _close(g, [[(1.0 - 0.5) / 3, 0.0, 0.0, 0.0]])


def test_value_loss_half_factor_and_agg_modes():
  data = _batch(seed=15)
  v, v_old = data['logp'], data['old_logp']
  ret, mask = data['ref_logp'], data['mask']
  for mode in MODES:
    loss, _ = val.value_loss(v, v_old, ret, mask, agg=mode, cliprange_value=0.2)
    vc = np.clip(v, v_old - 0.2, v_old + 0.2)
    per = np.maximum((v - ret) ** 2, (vc - ret) ** 2)
    _close(2 * loss, _np_agg(per, mask, mode))  # slime omits the ½


def test_value_loss_contracts():
  data = _batch(seed=16)
  v, v_old, ret, mask = (
    data['logp'],
    data['old_logp'],
    data['ref_logp'],
    data['mask'],
  )
  grads = jax.grad(
    lambda a, b: val.value_loss(v, a, b, mask, cliprange_value=0.05)[0],
    argnums=(0, 1),
  )(v_old, ret)
  assert not any(np.any(np.asarray(g)) for g in grads)
  junk = np.where(mask, 0, np.nan).astype(np.float32)

  def run(add):
    def f(x):
      return val.value_loss(x + add, v_old + add, ret + add, mask)

    return jax.value_and_grad(f, has_aux=True)(v)

  (l1, m1), g1 = run(np.zeros_like(junk))
  (l2, m2), g2 = run(junk)
  assert np.asarray(l1).tobytes() == np.asarray(l2).tobytes()
  assert np.asarray(g1).tobytes() == np.asarray(g2).tobytes()
  for k in m1:
    assert np.asarray(m1[k]).tobytes() == np.asarray(m2[k]).tobytes()
  empty = np.zeros_like(mask)
  for mode in MODES:
    val_, g = jax.value_and_grad(
      lambda x, mo=mode: val.value_loss(x, v_old, ret, empty, agg=mo)[0]
    )(v)
    assert float(val_) == 0.0 and not np.any(np.asarray(g))
  # Micro-batches with global counts reproduce the full batch.
  full = val.value_loss(v, v_old, ret, mask, agg='seq_mean_token_mean')[0]
  n_seq = mask.any(-1).sum()
  parts = sum(
    val.value_loss(
      v[s], v_old[s], ret[s], mask[s], agg='seq_mean_token_mean', num_seqs=n_seq
    )[0]
    for s in (slice(0, 4), slice(4, 8))
  )
  _close(parts, full, rtol=1e-6, atol=1e-7)
  jit_loss = jax.jit(lambda *a: val.value_loss(*a)[0])(v, v_old, ret, mask)
  _close(jit_loss, val.value_loss(v, v_old, ret, mask)[0], rtol=1e-6, atol=0)


@pytest.mark.parametrize('eps', [0, -0.1, True, None, 'x'])
def test_value_loss_bad_cliprange(eps):
  x = np.zeros((1, 2), np.float32)
  with pytest.raises(
    ValueError, match=r'cliprange_value.*allowed: a number > 0'
  ):
    val.value_loss(x, x, x, np.ones((1, 2), bool), cliprange_value=eps)


def test_value_loss_bad_agg_and_mask():
  x = np.zeros((1, 2), np.float32)
  with pytest.raises(ValueError, match=r"agg='mean'.*allowed"):
    val.value_loss(x, x, x, np.ones((1, 2), bool), agg='mean')
  with pytest.raises(ValueError, match='bool'):
    val.value_loss(x, x, x, np.ones((1, 2), np.float32))
  with pytest.raises(ValueError, match='shape mismatch'):
    val.value_loss(x, x[:, :1], x, np.ones((1, 2), bool))


def test_reinforce_reads_old_logp_for_its_metric_only():
  d = _batch(seed=17)
  lp = d.pop('logp')
  d.pop('old_logp')
  actor = obj.ActorLossConfig(policy_loss='reinforce')
  loss, met = obj.actor_objective(actor, None, logp=lp, **d)
  assert 'actor/ppo_kl' not in met
  gpg, _ = obj.actor_objective(
    obj.ActorLossConfig(policy_loss='gpg'), None, logp=lp, **d
  )
  np.testing.assert_array_equal(loss, gpg)


def test_value_loss_accepts_numpy_scalars():
  x = np.array([[0.0, 1.0]], np.float32)
  mask = np.ones((1, 2), bool)
  a, _ = val.value_loss(x, x, x + 1, mask, cliprange_value=np.float32(0.2))
  b, _ = val.value_loss(x, x, x + 1, mask, cliprange_value=0.2)
  np.testing.assert_allclose(a, b, rtol=1e-7)
  _close(a, 0.5)
