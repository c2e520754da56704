"""The actor objective and the value loss against SkyRL's goldens:
`rollout_kl_loss/*`, `compose/*` (D5), `critic/*`."""

import math

import jax
import numpy as np
import pytest

from jaxcorr.losses import correction as corr_lib
from jaxcorr.losses import objective_config as obj_cfg
from jaxcorr.losses import value as val
from tests.helpers import golden_data as gd
from tests.helpers import objective_batches as ob
from tests.helpers.tolerance import assert_close

SKYRL = gd.load('skyrl')


def _skyrl_params(group):
  return gd.case_params('skyrl', group=group)


@pytest.mark.parametrize('case', _skyrl_params('rollout_kl_loss'))
def test_skyrl_rollout_kl_loss(case):
  """PR #1811's rollout-KL = Krol with agg='seq_mean_token_mean'."""
  kw = SKYRL.kwargs(case)
  mask = kw['loss_mask'].astype(bool)
  actor = obj_cfg.ActorLossConfig(
    agg='seq_mean_token_mean',
    rollout_kl_type=kw['rollout_kl_estimator_type'],
    rollout_kl_coef=1.0,
  )
  loss, met, grad = ob.grad_logp(
    actor,
    None,
    kw['log_probs'],
    advantages=np.zeros_like(kw['log_probs']),
    mask=mask,
    old_logp=kw['log_probs'],
    rollout_logp=kw['rollout_logprobs'],
  )
  out = SKYRL.outputs(case)
  assert_close(met['actor/rollout_kl_loss'], out['rollout_kl'])
  assert_close(loss, out['rollout_kl'])
  assert_close(grad, out['grad_cur_logprobs'])


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
  assert_close(
    out['policy_loss'] + 1e-3 * out['kl_loss'] + 0.1 * out['rollout_kl_loss'],
    out['total_loss'],
  )
  assert_close(
    out['rollout_kl_loss'],
    SKYRL.outputs(SKYRL.case('rollout_kl_loss/k2'))['rollout_kl'],
  )
  cc = corr_lib.CorrectionConfig(**SKYRL_COMBO)
  actor = obj_cfg.ActorLossConfig(
    clip_ratio_c=None,  # SkyRL 'regular' has no dual clip
    kl_loss_type='k3',
    kl_loss_coef=1e-3,
    rollout_kl_type='k2',
    rollout_kl_coef=0.1,
  )
  corr = corr_lib.rollout_correction(old, ro, m0, cc)
  loss, met, grad = ob.grad_logp(
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
  assert_close(loss, want)
  assert_close(met['actor/rollout_kl_loss'], (krol * m).sum() / n)
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
  actor = obj_cfg.ActorLossConfig(clip_ratio_c=None, rollout_kl_coef=0.1)
  loss, met, grad = ob.grad_logp(
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
  assert_close(loss, out['loss'])
  assert_close(met['critic/vf_loss'], out['loss'])
  assert_close(met['critic/vf_clipfrac'], out['clipfrac'] or 0.0)
