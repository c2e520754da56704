"""Policy losses against SkyRL's goldens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.losses import policy
from tests.helpers import golden_data as gd
from tests.helpers import policy_replay as pr
from tests.helpers.tolerance import assert_close

# A SkyRL policy loss returns Σ ℓ·loss_mask of advantages pre-scaled by its
# loss_reduction. So every case is first asserted as jaxcorr's
# `agg='token_sum'` on `advantages_scaled` (loss and d loss/d logp). Where the
# reduction is a jaxcorr mode (token_mean → token_mean, sequence_mean →
# seq_mean_token_mean, seq_mean_token_sum_norm → the same with norm =
# max_seq_len) and ℓ is positively homogeneous in A, the raw advantages with
# that mode must give the same loss. `token_mean_legacy` (per micro-batch)
# and `prompt_mean` have no jaxcorr mode.
#
# Loss names: regular → vanilla with clip_ratio_c=None; dual_clip → vanilla;
# gspo, sapo, cispo (cispo_anchor='rollout' → old_logp := μ), clip_cov,
# kl_cov, rollout_is as named; dppo binary_tv → prime with prime_kl_tau=0
# (μ-anchored, docs/math/losses.md §4.3); dppo binary_kl → dppo_kl with old_logp
# := μ and no cap (same gradient, different surrogate value);
# importance_sampling → vanilla without clipping (−A·ρ); cross_entropy → gpg
# with A ≡ 1 (−logp).

SKYRL_MODES = {
  'token_mean': 'token_mean',
  'sequence_mean': 'seq_mean_token_mean',
  'seq_mean_token_sum_norm': 'seq_mean_token_sum_norm',
}
SKYRL_NOT_HOMOGENEOUS = ('kl_cov', 'clip_cov', 'gpg')


def skyrl_call(case):
  """Maps a SkyRL policy-loss call to (name, knobs, arrays, notes)."""
  kw = gd.load('skyrl').kwargs(case)
  cfg = kw['config']
  kind = cfg['policy_loss_type']
  k = {
    'clip_ratio_low': cfg['eps_clip_low'],
    'clip_ratio_high': cfg['eps_clip_high'],
  }
  old, roll = kw['old_log_probs'], kw.get('rollout_logprobs')
  adv = kw['advantages_scaled']
  name, value_ok = kind, True
  if kind in ('regular', 'dual_clip'):
    name = 'vanilla'
    k['clip_ratio_c'] = None if kind == 'regular' else cfg['clip_ratio_c']
  elif kind == 'cispo':
    c = cfg['cispo']
    k.update(
      cispo_clip_low=c['cispo_eps_clip_low'],
      cispo_clip_high=c['cispo_eps_clip_high'],
    )
    if c['cispo_anchor'] == 'rollout':
      old = roll
  elif kind == 'sapo':
    k.update(tau_pos=cfg['sapo']['tau_pos'], tau_neg=cfg['sapo']['tau_neg'])
  elif kind == 'clip_cov':
    c = cfg['clip_cov']
    k.update(
      clip_cov_ratio=c['clip_ratio'],
      clip_cov_lb=c['clip_cov_lb'],
      clip_cov_ub=c['clip_cov_ub'],
    )
  elif kind == 'kl_cov':
    c = cfg['kl_cov']
    k.update(kl_cov_ratio=c['kl_cov_frac'], ppo_kl_coef=c['ppo_kl_coef'])
  elif kind == 'dppo':
    c = cfg['dppo']
    if c['dppo_type'] == 'binary_tv':
      name = 'prime'
      k = {
        'prime_mask_low': c['delta_low'],
        'prime_mask_high': c['delta_high'],
        'prime_kl_tau': 0.0,
      }
    else:  # binary_kl: −A·ρ_μ·valid; jaxcorr's surrogate −A·sg(ρ_μ)·logp·valid
      name, old, value_ok = 'dppo_kl', roll, False
      k.update(
        dppo_delta_low=c['delta_low'],
        dppo_delta_high=c['delta_high'],
        clip_ratio_c=None,
      )
  elif kind == 'importance_sampling':
    name = 'vanilla'
    k.update(
      clip_ratio_low=1.0, clip_ratio_high=float('inf'), clip_ratio_c=None
    )
  elif kind == 'cross_entropy':
    name, k, adv = 'gpg', {}, np.ones_like(adv)
  return dict(
    name=name, knobs=k, old=old, rollout=roll, adv=adv, kw=kw, value_ok=value_ok,
    mask=kw['loss_mask'].astype(bool), logp=kw['log_probs'],
  )  # fmt: skip


def _skyrl_loss(a, adv, agg, norm=None, rollout=None):
  name = a['name']
  pick = a.get('pick')

  def fn(lp):
    return policy.policy_loss(
      name,
      lp,
      None if name == 'prime' else a['old'],
      adv,
      a['mask'],
      agg=agg,
      norm=norm,
      rollout_logp=rollout,
      key=jax.random.key(0),
      clip_cov_pick=pick,
      is_weights=a.get('w'),
      knobs=policy.check_knobs(a['knobs']),
    )

  return pr.value_grad(fn, a['logp'])


def _skyrl_apply_own_correction(case, a):
  """Feeds SkyRL's own correction output (its `opc/<combo>` golden, same
  inputs and config) to jaxcorr's policy loss as mask and IS weights.

  SkyRL's combos order token masks before sequence statistics (D17), so
  jaxcorr's correction legitimately differs there; this isolates the policy
  loss, which must then match SkyRL number for number.
  """
  gs = gd.load('skyrl')
  combo = case['id'].rsplit('/', 1)[1]
  opc = gs.outputs(gs.case(f'opc/{combo}'))
  a['mask'] = opc['loss_mask'].astype(bool)
  a['w'] = np.broadcast_to(opc['tis_ratio'], a['mask'].shape)


SKYRL_CASES = [
  *gd.case_params('skyrl', group='pl'),
  *gd.case_params('skyrl', group='pl_seqadv'),
]


@pytest.mark.parametrize('case', SKYRL_CASES)
def test_skyrl_policy_loss(case):
  gs = gd.load('skyrl')
  a = skyrl_call(case)
  if '/combo_' in case['id']:
    if a['name'] in ('gspo', 'gspo_seq'):
      pytest.skip(
        "D5/D17: SkyRL's GSPO sequence ratio averages the log-ratio over the "
        'pre-correction loss_mask; jaxcorr uses the corrected mask for every '
        'term'
      )
    if not policy.USES_IS_WEIGHTS[a['name']]:
      # SkyRL multiplies TIS weights into a loss that already divides by μ,
      # correcting twice; jaxcorr refuses that combination
      # (docs/math/losses.md §4.2).
      a['w'] = np.ones_like(a['logp'])
      with pytest.raises(ValueError, match='is_weights'):
        _skyrl_loss(a, a['adv'], 'token_sum', rollout=a['rollout'])
      return
    _skyrl_apply_own_correction(case, a)
  out = gs.outputs(case)
  rollout = a['rollout']
  if case['id'].endswith('/rollout_None'):
    # D8: SkyRL's DPPO silently falls back to old_log_probs; jaxcorr raises.
    with pytest.raises(ValueError, match='rollout_logp is required'):
      _skyrl_loss(a, a['adv'], 'token_sum')
    rollout = a['old']  # the fallback, made explicit
  if a['name'] == 'clip_cov' and 'randperm_used' in out:
    cand = pr.clip_cov_candidates(
      a['logp'], a['old'], a['adv'], a['mask'], a['knobs']
    )
    a['pick'] = pr.pick_from_randperm(
      {**case, '_perm': out['randperm_used']}, cand
    )
  (loss, metrics), grad = _skyrl_loss(a, a['adv'], 'token_sum', rollout=rollout)
  assert_close(grad, out['grad_cur_logprobs'], mask=a['mask'])
  clip = out['metrics'].get('clip_ratio')
  mine = metrics.get('actor/pg_clipfrac', metrics.get('actor/prime_is_masked'))
  # With a correction, SkyRL's clip_ratio still counts over the original
  # loss_mask while its loss uses the corrected one; jaxcorr's metrics use
  # the corrected mask like every other term (D5), so only loss and
  # gradient are compared there.
  combo = '/combo_' in case['id']
  if clip is not None and mine is not None and not combo:
    assert_close(mine, clip)
  if not a['value_ok']:
    return  # dppo binary_kl: gradient and clip fraction only (see above)
  ell = pr.per_token(
    a['name'], a['logp'], a['old'], a['adv'], a['mask'], rollout=rollout,
    clip_cov_pick=a.get('pick'), key=jax.random.key(0), **a['knobs'],
  )  # fmt: skip
  abs_terms = float(jnp.sum(jnp.where(a['mask'], jnp.abs(ell), 0)))
  assert_close(loss, out['loss'], scale=abs_terms)
  red = a['kw']['config']['loss_reduction']
  # SkyRL scaled its advantages with the pre-correction mask (D5), so the
  # raw-advantage check only applies without a correction.
  if combo:
    return
  if red in SKYRL_MODES and a['name'] not in SKYRL_NOT_HOMOGENEOUS:
    norm = (
      a['kw']['config']['max_seq_len']
      if red == 'seq_mean_token_sum_norm'
      else None
    )
    (raw, _), _ = _skyrl_loss(
      a, a['kw']['advantages_raw'], SKYRL_MODES[red], norm, rollout
    )
    np.testing.assert_allclose(raw, out['loss'], rtol=1e-5, atol=1e-6)
