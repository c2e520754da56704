"""AReaL KPop / IcePop (`frontier/areal`, AReaL `13353cc67`, PR #1405).

AReaL's `apply_rejection_sampling(proximal, old, loss_mask, cu_seqlens,
config)` compares the recomputed π_old ("proximal") with the behaviour
(rollout) log-probs; in jaxcorr that is `rollout_correction(train_logp=π_old,
rollout_logp=μ)` in decoupled mode. The config maps as follows:

| AReaL                                    | jaxcorr CorrectionConfig                 |
|------------------------------------------|------------------------------------------|
| ratio, token, mask, [lo, up]             | rs=token_k1 (lo, up); token IS, clip     |
| ratio, sequence, mask, mean, [lo, up]    | rs=seq_mean_k1 (lo, up); geometric IS    |
| ratio, token / sequence, clamp           | token / geometric IS, clip (truncate when lo = 0) |
| binary_kl (KPop), token / seq sum/mean/max | rs=token_bkl / seq_{sum,mean,max}_bkl, up; raw token IS |
| kl_k3, token                             | rs=token_k3, up                          |

Unset lower bounds of the ratio become 1e-30 (no bound). The weights
returned with `action='mask'` are the raw token ratios, i.e. token IS with
`is_mode='clip'` over a band that contains every kept ratio. The packed
layout (`cu_seqlens`) is unpacked to `[B, T]` and the outputs repacked.

Divergences (docs/correction.md §4): D23 (AReaL's config refuses its own
KPop metric; jaxcorr accepts `*_bkl`), D24 (p = 1 gives NaN in AReaL and the
token is silently rejected; jaxcorr's statistic is finite), D25 (a lower
bound on a KL statistic is refused), D5 (AReaL's PPO loss divides by the
pre-rejection token count; replayed with `num_tokens`).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.losses import correction, policy
from jaxcorr.losses.correction import CorrectionConfig, rejection
from tests.helpers import golden_data as gd
from tests.helpers.tolerance import TOL_GOLDEN_EXP, assert_close

FW = 'frontier/areal'
NO_LOWER = 1e-30
NO_UPPER = 1e30


def unpack(flat, cu):
  """Packed `[N]` + `cu_seqlens` → `[B, T]` (zero / False padding)."""
  lens = np.diff(cu)
  out = np.zeros((len(lens), max(int(lens.max()), 1)), flat.dtype)
  for i, (a, b) in enumerate(itertools.pairwise(cu)):
    out[i, : b - a] = flat[a:b]
  return out


def repack(x, cu):
  x = np.asarray(x)
  return np.concatenate(
    [x[i, : b - a] for i, (a, b) in enumerate(itertools.pairwise(cu))]
  )


def jaxcorr_config(rs_cfg):
  """AReaL's RejectionSamplingConfig → (CorrectionConfig, lower-on-KL)."""
  level, action, metric = rs_cfg['level'], rs_cfg['action'], rs_cfg['metric']
  up, lo = rs_cfg['upper'], rs_cfg['lower']
  seq = level == 'sequence'
  agg = {'mean': 'seq_mean', 'sum': 'seq_sum', 'max': 'seq_max'}[rs_cfg['agg']]
  if metric == 'ratio':
    band = (lo or NO_LOWER, up)
    is_level = 'geometric' if seq else 'token'
    if action == 'clamp':
      if not lo:
        return CorrectionConfig(is_level=is_level, is_upper=up), None
      return CorrectionConfig(
        is_level=is_level, is_mode='clip', is_lower=lo, is_upper=up
      ), None
    crit = 'seq_mean_k1' if seq else 'token_k1'
    cfg = CorrectionConfig(
      is_level=is_level, is_mode='clip', is_lower=band[0], is_upper=up,
      rs=(crit,), rs_bounds=(band,),
    )  # fmt: skip
    return cfg, None
  stat = {'binary_kl': 'bkl', 'kl_k3': 'k3'}[metric]
  crit = f'{agg}_{stat}' if seq else f'token_{stat}'
  cfg = CorrectionConfig(
    is_level='token', is_mode='clip', is_lower=NO_LOWER, is_upper=NO_UPPER,
    rs=(crit,), rs_bounds=(up,),
  )  # fmt: skip
  return cfg, lo


def run_correction(kw, rs_cfg, prox='proximal_logprobs', beh='old_logprobs'):
  cu = kw.get('cu_seqlens')
  arrs = [kw[prox], kw[beh], kw['loss_mask'].astype(bool)]
  if cu is not None:
    arrs = [unpack(a, cu) for a in arrs]
  train, roll, mask = (jnp.asarray(a) for a in arrs)
  cfg, kl_lower = jaxcorr_config(rs_cfg)
  out = correction.rollout_correction(train, roll, mask, cfg)
  keep, w = np.asarray(out.mask), np.asarray(out.weights)
  if rs_cfg['metric'] == 'kl_k3':
    # D26: AReaL's k3 is taken of log(μ/π_old), jaxcorr's (verl's) of
    # log(π_old/μ); AReaL's mask is jaxcorr's with the roles swapped.
    swapped = correction.rollout_correction(roll, train, mask, cfg)
    assert not np.array_equal(np.asarray(swapped.mask), keep)
    keep = np.asarray(swapped.mask)
    w = np.where(keep, np.exp(np.asarray(train - roll)), 0)
  if kl_lower is not None:
    # D25: jaxcorr has no lower bound on a KL statistic; AReaL's extra
    # condition is applied here on jaxcorr's own KPop statistic.
    stat = np.asarray(rejection.kpop_statistic(train, roll, mask))
    keep = keep & (stat >= kl_lower)
    w = np.where(keep, w, 0)
  return out, keep, w, np.asarray(mask), cu


def _metric_filtered(rs_cfg, keep, w, mask):
  """AReaL's `filtered_fraction`: rejected, or clamped, valid tokens over
  valid tokens. A clamped token carries exactly a bound as its weight."""
  if rs_cfg['action'] == 'clamp':
    lo = np.float32(rs_cfg['lower'] or 0)
    up = np.float32(rs_cfg['upper'])
    return ((w == up) | (w == lo))[mask].mean()
  return 1 - keep.sum() / mask.sum()


@pytest.mark.parametrize('case', gd.case_params(FW, prefix='rs/'))
def test_rejection(case):
  gs = gd.load(FW)
  kw = gs.kwargs(case)
  rs_cfg = kw['config']
  _, keep, w, mask, cu = run_correction(kw, rs_cfg)
  want = gs.outputs(case)
  got_mask, got_w = keep, w
  if cu is not None:
    got_mask, got_w = repack(keep, cu), repack(w, cu)
  np.testing.assert_array_equal(got_mask, want['loss_mask'].astype(bool))
  assert_close(got_w, want['behave_imp_weight'], TOL_GOLDEN_EXP)
  np.testing.assert_allclose(
    _metric_filtered(rs_cfg, keep, w, mask), want['filtered_fraction'],
    rtol=1e-6,
  )  # fmt: skip


@pytest.mark.parametrize('case', gd.case_params(FW, prefix='binary_kl_div/'))
def test_binary_kl(case):
  gs = gd.load(FW)
  kw = gs.kwargs(case)
  want = gs.outputs(case)['kl']
  got = np.asarray(
    rejection.bernoulli_kl(
      jnp.asarray(kw['log_p']), jnp.asarray(kw['log_q']), eps=kw['eps']
    )
  )
  lp = kw['log_p'].astype(np.float64)
  lq = kw['log_q'].astype(np.float64)
  # AReaL's float32 `1 − p` cancels when p ≈ 1: compare to it where both
  # 1 − p and 1 − q are ≥ 1e-3, and everywhere to a float64 derivation.
  finite = np.isfinite(want) & (lp < np.log1p(-1e-3)) & (lq < np.log1p(-1e-3))
  np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=3e-7)
  p, q = np.clip(np.exp(lp), 1e-8, 1), np.clip(np.exp(lq), 1e-8, 1)
  p1 = np.maximum(-np.expm1(np.minimum(lp, 0)), 1e-8)
  q1 = np.maximum(-np.expm1(np.minimum(lq, 0)), 1e-8)
  exact = p * np.log(p / q) + p1 * np.log(p1 / q1)
  np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-6)
  # D24: where AReaL's float32 clamp fails (p or q = 1) jaxcorr is finite.
  assert np.all(np.isfinite(got))
  same = kw['log_p'] == kw['log_q']
  np.testing.assert_allclose(got[same], 0, atol=1e-7)


@pytest.mark.parametrize('case', gd.case_params(FW, prefix='config/'))
def test_d23_areal_config_refuses_kpop_jaxcorr_accepts_it(case):
  gs = gd.load(FW)
  assert gs.error(case)['type'] == 'ValueError'
  cfg = CorrectionConfig(rs='token_bkl', rs_bounds=case['kwargs']['upper'])
  assert cfg.rs == ('token_bkl',) and cfg.rs_bounds == ((None, 2.0),)


def test_d24_certain_token_is_kept_not_silently_rejected():
  """AReaL: p = q = 1 gives NaN and NaN ≤ upper is False, so the token is
  rejected. jaxcorr: KL = 0, kept."""
  lp = jnp.asarray([[0.0, -0.5, -1e-9]])
  mask = jnp.ones(lp.shape, bool)
  out = correction.rollout_correction(
    lp, lp, mask, CorrectionConfig(rs='token_bkl', rs_bounds=0.01)
  )
  assert bool(jnp.all(out.mask))
  stat = rejection.kpop_statistic(lp, lp, mask)
  np.testing.assert_allclose(stat, 0, atol=1e-7)


def test_d25_kl_statistic_takes_no_lower_bound():
  with pytest.raises(ValueError, match='rs_bounds'):
    CorrectionConfig(rs='token_bkl', rs_bounds=((0.001, 0.1),))


@pytest.mark.parametrize('case', gd.case_params(FW, prefix='ppo/'))
def test_ppo_loss_with_rejection(case):
  gs = gd.load(FW)
  kw = gs.kwargs(case)
  rs_cfg = kw['rejection_sampling']
  cu = kw.get('cu_seqlens')
  names = ('logprobs', 'proximal_logprobs', 'old_logprobs', 'advantages')
  arrs = {k: kw[k] for k in names}
  mask0 = kw['loss_mask'].astype(bool)
  if cu is not None:
    arrs = {k: unpack(v, cu) for k, v in arrs.items()}
    mask0 = unpack(mask0, cu)
  if rs_cfg is None:
    keep, w = mask0, None
  else:
    sub = {**kw, **arrs, 'loss_mask': mask0, 'cu_seqlens': None}
    _, keep, w, _, _ = run_correction(sub, rs_cfg)
  seq = kw['importance_sampling_level'] == 'sequence'
  eps = kw['eps_clip']
  hi = kw['eps_clip_higher']
  knobs = dict(
    clip_ratio_low=eps,
    clip_ratio_high=eps if hi is None else hi,
  )
  if not seq:
    knobs['clip_ratio_c'] = kw['c_clip']

  adv = arrs['advantages']
  if seq:
    # AReaL's sequence level also averages the advantage over the row (a
    # sequence-level advantage, which jaxcorr's GSPO takes as given).
    n = np.maximum(keep.sum(-1, keepdims=True), 1)
    adv = np.broadcast_to(
      (np.where(keep, adv, 0).sum(-1, keepdims=True) / n), adv.shape
    )

  def fn(lp):
    return policy.policy_loss(
      'gspo_seq' if seq else 'vanilla', lp, jnp.asarray(arrs['proximal_logprobs']),
      jnp.asarray(adv), jnp.asarray(keep),
      is_weights=None if w is None else jnp.asarray(w), agg='token_mean',
      # D5: AReaL divides by the pre-rejection token count.
      num_tokens=float(mask0.sum()),
      knobs=policy.check_knobs(knobs),
    )  # fmt: skip

  (loss, _), grad = jax.value_and_grad(fn, has_aux=True)(
    jnp.asarray(arrs['logprobs'])
  )
  want = gs.outputs(case)
  assert_close(loss, want['loss'])
  grad = np.asarray(grad)
  if cu is not None:
    grad = repack(grad, cu)
  assert_close(grad, want['grad_logprobs'])
  if rs_cfg is not None:
    got = repack(keep, cu) if cu is not None else keep
    np.testing.assert_array_equal(got, want['stat_behave_mask'].astype(bool))
