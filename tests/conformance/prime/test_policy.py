"""Policy losses against prime-rl's goldens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.losses import policy
from tests.helpers import golden_data as gd
from tests.helpers import policy_replay as pr
from tests.helpers.tolerance import TOL_GOLDEN_METRICS, assert_close

# prime-rl has no π_old: trainer_logprobs = π_θ, inference_logprobs = μ. Its
# loss functions run once per sample and return a *sum* over the sample, so
# jaxcorr runs `policy_loss(..., agg='token_sum')` vmapped over rows ([1, T]
# each): per-row losses, per-row metrics, and the gradient of their sum
# (= the concatenated per-sample gradients).
#
# head/default_loss_fn → prime (dppo_mask_low/high → prime_mask_low/high,
# adv_tau → prime_adv_tau, kl_tau → prime_kl_tau).
#
# legacy/default_loss_fn (bf71516c9) is *not* jaxcorr's prime: it is
# `−Σ_keep sg(ρ_μ·(τ_A·A − τ_KL·r))·logp` with a token band
# [token_mask_low, token_mask_high] on ρ_μ and row-level geo/min/max masks.
# With τ_KL = 0 and token ratios it is `rollout_is` with the band
# (1 − ε_l, 1 + ε_h) = (token_mask_low, token_mask_high) on the mask left by
# the row-level masks (a rejection, i.e. the correction's job; built here).


def _rowwise(name, logp, adv, mask, rollout, **knobs):
  def one(lp, a, m, r):
    return policy.policy_loss(
      name, lp[None], None, a[None], m[None], rollout_logp=r[None],
      agg='token_sum', knobs=policy.check_knobs(knobs),
    )  # fmt: skip

  def total(lp):
    per, metrics = jax.vmap(one)(lp, adv, mask, rollout)
    return jnp.sum(per), (per, metrics)

  (_, (per, metrics)), grad = jax.value_and_grad(total, has_aux=True)(
    jnp.asarray(logp)
  )
  return per, metrics, grad


PRIME_METRICS = {
  'metric/is_masked': 'actor/prime_is_masked',
  'metric/is_masked_low': 'actor/prime_is_masked_low',
  'metric/is_masked_high': 'actor/prime_is_masked_high',
  'metric/masked_mismatch_kl': 'actor/prime_masked_mismatch_kl',
  'metric/unmasked_mismatch_kl': 'actor/prime_unmasked_mismatch_kl',
}


def _legacy_skip_reason(cfg):
  if cfg['ratio_type'] != 'token':
    return (
      'legacy ratio_type=sequence: a clipped, detached sequence ratio '
      'divided by the row length is not a jaxcorr policy loss'
    )
  if cfg['teacher_tau'] != 0:
    return 'legacy teacher_tau: teacher distillation is not a policy loss'
  if cfg['kl_tau'] != 0:
    return (
      'legacy kl_tau: its KL enters as −sg(ρ_μ·(−τ·r))·logp on kept tokens '
      '(gradient τ·ρ_μ·r); jaxcorr has τ·r² on every token (prime) or the '
      'rollout-KL term ½r² (gradient r), so it is not expressible'
    )
  return None


PRIME_CASES = [
  *gd.case_params('prime', group='head/default_loss_fn'),
  *gd.case_params('prime', group='legacy/default_loss_fn'),
]


@pytest.mark.parametrize('case', PRIME_CASES)
def test_prime_default_loss(case):
  gs = gd.load('prime')
  kw, out = gs.kwargs(case), gs.outputs(case)
  cfg = kw['loss_config']
  _, lengths, unpack = pr.packed_inputs(gs)
  if 'loss_weights' in kw:
    pytest.skip(
      'prime-rl loss_weights multiply the per-token loss; jaxcorr prime '
      'takes no per-token weights (is_weights is an error for it, '
      'docs/math/losses.md §4.2)'
    )
  logp = unpack(kw['trainer_logprobs'])
  roll = unpack(kw['inference_logprobs'])
  adv = unpack(kw['advantages'])
  mask = unpack(kw['loss_mask']).astype(bool)
  if case['group'].startswith('head/'):
    name = 'prime'
    knobs = {
      'prime_mask_low': cfg['dppo_mask_low'],
      'prime_mask_high': cfg['dppo_mask_high'],
      'prime_adv_tau': cfg['adv_tau'],
      'prime_kl_tau': cfg['kl_tau'],
    }
  else:
    reason = _legacy_skip_reason(cfg)
    if reason:
      pytest.skip(reason)
    name = 'rollout_is'
    knobs = {
      'clip_ratio_low': 1 - cfg['token_mask_low'],
      'clip_ratio_high': cfg['token_mask_high'] - 1,
    }
    r = np.where(mask, logp - roll, 0)
    rho = np.exp(r)
    geo = np.exp(r.sum(-1) / np.maximum(mask.sum(-1), 1))
    lo = np.where(mask, rho, np.inf).min(-1)
    hi = np.where(mask, rho, -np.inf).max(-1)
    rejected = (geo < cfg['geo_mask_low']) | (geo > cfg['geo_mask_high'])
    rejected |= (lo < cfg['sequence_mask_low']) | (
      hi > cfg['sequence_mask_high']
    )
    mask = mask & ~rejected[:, None]
  per, metrics, grad = _rowwise(name, logp, adv, mask, roll, **knobs)
  ell = jax.vmap(
    lambda lp, a, m, r: pr.per_token(
      name, lp[None], None, a[None], m[None], rollout=r[None], **knobs
    )
  )(logp, adv, mask, roll)
  abs_terms = np.abs(np.asarray(ell)).reshape(len(lengths), -1).sum(-1)
  for i, want in enumerate(out['per_sample_loss']):
    assert_close(per[i], want, scale=abs_terms[i])
  assert_close(pr.pack(grad, lengths), out['grad_trainer_logprobs'])
  if name == 'prime':
    for theirs, ours in PRIME_METRICS.items():
      assert_close(metrics[ours], out[theirs], TOL_GOLDEN_METRICS, what=theirs)


@pytest.mark.golden('prime')
def test_prime_importance_ratio_and_mismatch_kl():
  """head/compute_importance_ratio_and_mismatch_kl through prime's metrics.

  With nothing masked (bands at +inf), `prime_unmasked_mismatch_kl` of a row
  is the mean of prime-rl's per-token `ρ_μ − log ρ_μ − 1` over the row's
  loss-mask tokens. prime-rl does not clamp r (D11); here |r| ≤ 5.3.
  """
  gs = gd.load('prime')
  case = gs.case('head/compute_importance_ratio_and_mismatch_kl')
  kw, out = gs.kwargs(case), gs.outputs(case)
  _, lengths, unpack = pr.packed_inputs(gs)
  logp = unpack(kw['trainer_logprobs'])
  roll = unpack(kw['inference_logprobs'])
  mask = unpack(gs.dataset()['flat_loss_mask']).astype(bool)
  np.testing.assert_allclose(
    out['log_importance_ratio'],
    kw['trainer_logprobs'] - kw['inference_logprobs'],
  )
  adv = np.ones_like(logp)
  inf = float('inf')
  _, metrics, _ = _rowwise(
    'prime', logp, adv, mask, roll, prime_mask_low=inf, prime_mask_high=inf
  )
  mkl = unpack(out['mismatch_kl'])
  want = np.array([mkl[i][mask[i]].mean() for i in range(len(lengths))])
  assert_close(
    metrics['actor/prime_unmasked_mismatch_kl'], want, TOL_GOLDEN_METRICS
  )
  np.testing.assert_array_equal(metrics['actor/prime_is_masked'], 0.0)
