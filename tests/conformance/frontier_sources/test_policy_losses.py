"""Stale-data and μ-anchored policy losses against the frontier goldens.

* `frontier/skyrl_frontier` (SkyRL `dda1cb3c8` #1859, `1c32924a2` #1314,
  `e713bdeb2`): rollout-anchored CISPO → `cispo_rollout`, `rollout_is`,
  DPPO → `dppo_mu_tv` / `dppo_mu_kl`. A SkyRL loss returns Σ ℓ·loss_mask of
  raw advantages, i.e. jaxcorr's `agg='token_sum'`.
* `frontier/verl_pr` (verl PR heads #4131 M2PO, #6986 TOPR): `m2po`, `topr`
  and M2PO's threshold helpers.

Divergences (docs/correction.md §4) are asserted with jaxcorr's own value:
D8 (a missing rollout log-prob raises instead of falling back), D19 (a
μ-anchored loss refuses IS weights: SkyRL multiplies TIS into it, correcting
twice), D22 (TOPR honours an explicit `agg`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.losses import correction, policy
from jaxcorr.losses.correction import CorrectionConfig
from jaxcorr.losses.policy import ratio
from tests.helpers import golden_data as gd
from tests.helpers.tolerance import TOL_EQUIVALENT, assert_close

SKY = 'frontier/skyrl_frontier'
PR = 'frontier/verl_pr'


def _run(
  name, kw, mask, *, agg, old=None, rollout=None, w=None, num_seqs=None,
  **knobs,
):  # fmt: skip
  def fn(logp):
    return policy.policy_loss(
      name,
      logp,
      old,
      jnp.asarray(kw['advantages']),
      jnp.asarray(mask),
      agg=agg,
      rollout_logp=rollout,
      is_weights=w,
      num_seqs=num_seqs,
      knobs=policy.check_knobs(knobs),
    )

  logp = jnp.asarray(kw.get('log_probs', kw.get('log_prob')))
  return jax.value_and_grad(fn, has_aux=True)(logp)


# ==================================================================== SkyRL


def skyrl_args(kw):
  cfg = kw['config']
  kind = cfg['policy_loss_type']
  knobs = {
    'clip_ratio_low': cfg['eps_clip_low'],
    'clip_ratio_high': cfg['eps_clip_high'],
  }
  old, roll = kw['old_log_probs'], kw.get('rollout_logprobs')
  if kind == 'cispo':
    c = cfg['cispo']
    knobs = {
      'cispo_clip_low': c['cispo_eps_clip_low'],
      'cispo_clip_high': c['cispo_eps_clip_high'],
    }
    name = 'cispo_rollout' if c['cispo_anchor'] == 'rollout' else 'cispo'
  elif kind == 'dppo':
    c = cfg['dppo']
    name = {'binary_tv': 'dppo_mu_tv', 'binary_kl': 'dppo_mu_kl'}[
      c['dppo_type']
    ]
    knobs = {
      'dppo_delta_low': c['delta_low'],
      'dppo_delta_high': c['delta_high'],
    }
  else:
    name = kind
  return name, knobs, old, roll


def skyrl_mask_and_weights(kw, old, roll):
  """SkyRL's off-policy correction in jaxcorr terms: the outlier token mask
  (any token of a row with ratio π_old/μ outside [lo, hi] drops the row) is
  the veto; token TIS with cap 2 is token-level truncated IS."""
  mask = kw['loss_mask'].astype(bool)
  opc = kw['config']['off_policy_correction']
  lo = opc['outlier_token_is_threshold_low']
  hi = opc['outlier_token_is_threshold_high']
  tis = opc['tis_ratio_type']
  if lo is None and hi is None and tis is None:
    return mask, None
  cfg = CorrectionConfig(
    is_level='token' if tis == 'token' else None,
    is_upper=opc['token_tis_ratio_clip_high'],
    veto_low=lo,
    veto_high=hi,
  )
  corr = correction.rollout_correction(
    jnp.asarray(old), jnp.asarray(roll), jnp.asarray(mask), cfg
  )
  return np.asarray(corr.mask), (
    None if tis is None else np.asarray(corr.weights)
  )


@pytest.mark.parametrize('case', gd.case_params(SKY))
def test_skyrl_frontier(case):
  gs = gd.load(SKY)
  cid = case['id']
  if cid == 'cispo_anchor/config/invalid_anchor':
    # The anchor is chosen by the loss name ('cispo' or 'cispo_rollout'): an
    # unknown anchor is an unknown loss name, refused the same way.
    with pytest.raises(ValueError, match='unknown policy loss'):
      policy.check_knobs({}, 'cispo_behavior')
    return
  kw = gs.kwargs(case)
  name, knobs, old, roll = skyrl_args(kw)
  if roll is None and name in policy.READS and policy.READS[name] == 'rollout':
    # D8: SkyRL asserts (CISPO, rollout_is) or falls back to π_old (DPPO);
    # jaxcorr always raises. The DPPO fallback is replayed explicitly.
    with pytest.raises(ValueError, match='rollout_logp is required'):
      _run(name, kw, kw['loss_mask'].astype(bool), agg='token_sum', **knobs)
    if gs.error(case) is not None:
      return
    roll = old
  mask, w = skyrl_mask_and_weights(kw, old, roll)
  if w is not None and not policy.USES_IS_WEIGHTS[name]:
    # D19: SkyRL raises for rollout-anchored CISPO but multiplies TIS into
    # rollout_is and DPPO; jaxcorr refuses IS weights on every μ-anchored
    # loss (they already divide by μ).
    with pytest.raises(ValueError, match='is_weights must be None'):
      _run(name, kw, mask, agg='token_sum', old=old, rollout=roll, w=w)
    return
  assert gs.error(case) is None, cid
  # rollout_is at 1c32924a2 (PR #1314) still reduced with its own
  # loss_reduction (token_mean) instead of returning the sum.
  agg = 'token_mean' if name == 'rollout_is' else 'token_sum'
  (loss, met), grad = _run(
    name, kw, mask, agg=agg, old=old, rollout=roll, w=w, **knobs
  )
  out = gs.outputs(case)
  abs_terms = float(np.sum(np.abs(out['grad_log_probs'])))
  assert_close(loss, out['loss'], scale=abs_terms)
  assert_close(np.asarray(grad)[mask], out['grad_log_probs'][mask])
  ref = out['metrics']
  if not np.array_equal(mask, kw['loss_mask'].astype(bool)):
    # D5: SkyRL's metrics still count over the pre-correction loss_mask;
    # jaxcorr's use the corrected mask like every other term.
    return
  np.testing.assert_allclose(
    met['actor/pg_clipfrac'], ref['clip_ratio'], atol=1e-7
  )
  if name in ('cispo', 'cispo_rollout'):
    for key in ('ratio_mean', 'ratio_clamped_mean', 'ratio_max', 'ratio_min'):
      np.testing.assert_allclose(
        met[f'actor/cispo_{key}'], ref[f'cispo/{key}'], rtol=1e-5
      )


def test_d20_skyrl_and_verl_dppo_share_the_gradient_not_the_value():
  """SkyRL's DPPO (−A·ρ_μ·valid, μ-anchored) and verl's (−A·sg(min(ρ, c))·
  logp·valid) have the same gradient where the cap does not bind and the
  same anchor, but different loss values (D20)."""
  gs = gd.load(SKY)
  data = gs.dataset()
  mask = jnp.asarray(data['loss_mask'].astype(bool))
  args = (
    jnp.asarray(data['old_logprobs']),
    jnp.asarray(data['advantages']),
    mask,
  )
  deltas = dict(dppo_delta_low=0.2, dppo_delta_high=0.2)
  roll = jnp.asarray(data['rollout_logprobs'])

  def mu_loss(lp):
    return policy.policy_loss(
      'dppo_mu_tv', lp, None, *args[1:], rollout_logp=roll, agg='token_sum',
      knobs=policy.check_knobs(deltas),
    )[0]  # fmt: skip

  def verl_loss(lp):
    return policy.policy_loss(
      'dppo_tv', lp, roll, *args[1:], agg='token_sum',
      knobs=policy.check_knobs(dict(clip_ratio_c=1e6, **deltas)),
    )[0]  # fmt: skip

  lp = jnp.asarray(data['cur_logprobs'])
  g_mu, g_verl = jax.grad(mu_loss)(lp), jax.grad(verl_loss)(lp)
  np.testing.assert_allclose(g_mu[mask], g_verl[mask], rtol=1e-5, atol=1e-6)
  assert abs(float(mu_loss(lp)) - float(verl_loss(lp))) > 1.0


# ================================================================= verl PRs


@pytest.mark.parametrize('case', gd.case_params(PR, prefix='m2po/'))
def test_m2po(case):
  gs = gd.load(PR)
  kw = gs.kwargs(case)
  pl = kw['config']['policy_loss']
  mask = kw['response_mask'].astype(bool)
  knobs = {'m2_budget': pl['m2_budget']}
  if 'miniclip_low' in pl:
    knobs['m2po_miniclip_low'] = pl['miniclip_low']
    knobs['m2po_miniclip_high'] = pl['miniclip_high']
  w = kw.get('rollout_is_weights')
  mode = kw['loss_agg_mode']
  (loss, met), grad = _run(
    'm2po', kw, mask, agg=mode,
    old=jnp.asarray(kw['old_log_prob']),
    w=None if w is None else jnp.asarray(w), **knobs,
  )  # fmt: skip
  out = gs.outputs(case)
  if mode == 'seq-mean-token-sum-norm':
    # D21: the PR's base `agg_loss` divides Σ_i Σ_t ℓ by T only; jaxcorr's
    # (and verl's current) mode also averages over the sequences.
    rows = float(np.sum(mask.any(-1)))
    loss, grad = loss * rows, grad * rows
  # near-zero losses are reproducible to ~2e-9 absolute (README, Tolerances)
  np.testing.assert_allclose(loss, out['pg_loss'], rtol=1e-5, atol=1e-8)
  np.testing.assert_allclose(
    np.asarray(grad)[mask], out['grad_log_prob'][mask], rtol=1e-5, atol=1e-8
  )
  for key, want in gs.metrics(case).items():
    np.testing.assert_allclose(met[key], want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('case', gd.case_params(PR, prefix='m2po_helper/'))
def test_m2po_threshold_helpers(case):
  gs = gd.load(PR)
  kw = gs.kwargs(case)
  out = gs.outputs(case)
  if 'solve_tau' in case['id']:
    d2 = jnp.asarray(kw['sorted_delta2'], jnp.float32)
    n = jnp.asarray(d2.shape[0], jnp.float32)
    target = jnp.asarray(kw['target_sum'], jnp.float32)
    if d2.shape[0] == 0 or float(jnp.sum(d2)) <= kw['target_sum']:
      # verl returns its 'unconstrained' τ (1e5); jaxcorr's callers never
      # call the solver then (m2po_bounds handles it first).
      assert out['tau'] >= float(jnp.sqrt(jnp.max(d2, initial=0)))
      return
    tau = ratio.water_fill_tau(d2, n, target)
    np.testing.assert_allclose(tau, out['tau'], rtol=1e-6)
    after = jnp.mean(jnp.minimum(d2, tau**2))
    np.testing.assert_allclose(after, out['m2_after'], rtol=1e-5)
    return
  lp, old = jnp.asarray(kw['log_prob']), jnp.asarray(kw['old_log_prob'])
  adv = jnp.asarray(kw['advantages'])
  mask = jnp.asarray(kw['response_mask'].astype(bool))
  rho = jnp.exp(lp - old)
  harmful = mask & (((adv > 1e-12) & (rho > 1)) | ((adv < -1e-12) & (rho < 1)))
  np.testing.assert_allclose(
    np.square(np.asarray(old - lp))[np.asarray(harmful)],
    out['harmful_delta_sq'],
    rtol=1e-6,
  )
  lo, hi, m2, after = ratio.m2po_bounds(old - lp, harmful, kw['KL2_budget'])
  np.testing.assert_allclose(lo, out['clip_low'], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(hi, out['clip_high'], rtol=1e-6)
  np.testing.assert_allclose(m2, out['m2_before'], rtol=1e-6)
  np.testing.assert_allclose(after, out['m2_after'], rtol=1e-5)


@pytest.mark.parametrize('case', gd.case_params(PR, prefix='topr/'))
def test_topr(case):
  gs = gd.load(PR)
  kw = gs.kwargs(case)
  cfg = kw['config']
  pl = cfg['policy_loss']
  mask = kw['response_mask'].astype(bool)
  gbi = cfg['global_batch_info']
  # verl: Σ row means / global_batch_size · dp_size on each rank; on dp
  # equal shards that is jaxcorr's global seq_mean_token_mean with
  # num_seqs = global_batch_size / dp_size per shard.
  num_seqs = gbi['global_batch_size'] / gbi['dp_size'] if gbi else None
  w = kw.get('rollout_is_weights')
  # TOPR at the PR head ignores loss_agg_mode (always seq-mean-token-mean);
  # jaxcorr honours an explicit agg (D22), so the reference's effective mode
  # is passed here.
  (loss, met), grad = _run(
    'topr', kw, mask, agg='seq_mean_token_mean', num_seqs=num_seqs,
    old=jnp.asarray(kw['old_log_prob']),
    w=None if w is None else jnp.asarray(w),
    topr_negative_ratio_lower=pl['topr_negative_ratio_lower'],
    topr_negative_ratio_upper=pl['topr_negative_ratio_upper'],
  )  # fmt: skip
  out = gs.outputs(case)
  assert_close(loss, out['pg_loss'])
  assert_close(np.asarray(grad)[mask], out['grad_log_prob'][mask])
  for key, want in gs.metrics(case).items():
    np.testing.assert_allclose(met[key], want, rtol=1e-5, atol=1e-7)


def test_d22_topr_honours_an_explicit_agg():
  gs = gd.load(PR)
  case = gs.case('topr/default/token-mean')
  kw = gs.kwargs(case)
  mask = kw['response_mask'].astype(bool)
  args = dict(old=jnp.asarray(kw['old_log_prob']))
  (tm, _), _ = _run('topr', kw, mask, agg='token_mean', **args)
  (sm, _), _ = _run('topr', kw, mask, agg=None, **args)
  assert_close(sm, gs.outputs(case)['pg_loss'], TOL_EQUIVALENT)
  assert abs(float(tm) - float(sm)) > 1e-3


def test_m2po_selection_is_batch_global():
  """One τ per call: the same rows give other bounds inside a larger batch."""
  gs = gd.load(PR)
  d = gs.dataset()
  mask = jnp.asarray(d['loss_mask'].astype(bool))
  lp, old = jnp.asarray(d['cur_logprobs']), jnp.asarray(d['rollout_logprobs'])
  adv = jnp.asarray(d['advantages'])
  knobs = policy.check_knobs({'m2_budget': 0.3}, 'm2po')
  full = policy.policy_loss('m2po', lp, old, adv, mask, knobs=knobs)[1]
  half = policy.policy_loss(
    'm2po', lp[:6], old[:6], adv[:6], mask[:6], knobs=knobs
  )[1]
  assert float(full['m2po/clip_high']) != float(half['m2po/clip_high'])


def test_new_losses_zero_padding_and_jit():
  gs = gd.load(PR)
  d = gs.dataset()
  mask = jnp.asarray(d['loss_mask'].astype(bool))
  lp, old = jnp.asarray(d['cur_logprobs']), jnp.asarray(d['rollout_logprobs'])
  adv = jnp.asarray(d['advantages'])
  junk = jnp.where(mask, 0.0, jnp.nan)
  for name in ('m2po', 'topr', 'cispo_rollout', 'dppo_mu_tv', 'dppo_mu_kl'):
    reads_mu = policy.READS[name] == 'rollout'

    def fn(lp, old, adv, name=name, reads_mu=reads_mu):
      return policy.policy_loss(
        name, lp, None if reads_mu else old, adv, mask,
        rollout_logp=old if reads_mu else None,
      )[0]  # fmt: skip

    clean = fn(lp, old, adv)
    dirty = jax.jit(fn)(lp + junk, old + junk, adv + junk)
    np.testing.assert_allclose(dirty, clean, rtol=1e-6, err_msg=name)
    assert np.isfinite(float(clean)), name
