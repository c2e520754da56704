"""Policy losses against the verl, SkyRL, slime and prime-rl goldens.

Each parametrised case replays one recorded call of the reference function
(marked `golden(<framework>)`, so it shows in the per-framework conformance
summary printed at the end of the run). Mappings from the references'
arguments to `policy_loss` are spelled out next to each framework; cases that
jaxcorr does not reproduce on purpose are skipped with the reason, and the
divergences D9 and D12 have their own tests that assert jaxcorr's own value.

Tolerances (docs/math/README.md §6): rtol = atol =
1e-6 in float32; for sums (token_sum, seq_mean_token_sum, the SkyRL, slime and
prime-rl sums) the atol is scaled by the same aggregation of |ℓ|.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.losses import aggregate as agg_lib
from jaxcorr.losses import policy
from jaxcorr.losses.policy_base import LossInputs
from tests.helpers import golden_data as gd

RTOL = 1e-6
ATOL = 1e-6


def per_token(name, logp, old, adv, mask, *, w=None, rollout=None, **kw):
  """jaxcorr's per-token ℓ of `LOSSES[name]` (inputs sanitised here)."""
  mask = jnp.asarray(mask, bool)

  def clean(v):
    return (
      None if v is None else jnp.where(mask, jnp.asarray(v, jnp.float32), 0)
    )

  x = LossInputs(
    logp=clean(logp),
    old_logp=clean(old),
    rollout_logp=clean(rollout),
    adv=clean(adv),
    w=clean(w),
    mask=mask,
    key=kw.pop('key', None),
    pick=kw.pop('clip_cov_pick', None),
  )
  return policy.LOSSES[name].fn(x, policy.check_knobs(kw))[0]


def assert_loss(got, want, abs_terms):
  """`got ≈ want` with atol scaled by the aggregated |ℓ| (at least 1)."""
  scale = max(1.0, float(abs_terms))
  np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * scale)


def assert_masked(got, want, mask, **tol):
  tol = {'rtol': RTOL, 'atol': ATOL, **tol}
  np.testing.assert_allclose(np.asarray(got)[mask], want[mask], **tol)


def value_grad(fn, logp):
  """`((loss, metrics), d loss / d logp)` of `fn(logp)`."""
  return jax.value_and_grad(fn, has_aux=True)(jnp.asarray(logp))


def pick_from_randperm(case, cand):
  """The golden clip_cov selection: candidates in row-major order, kept at
  `randperm_used[:n_selected]` (README, RNG section)."""
  rng = case['rng']
  idx = np.argwhere(cand)
  assert len(idx) == rng['n_candidates'], (len(idx), rng)
  perm = np.asarray(case['_perm'])[: rng['n_selected']]
  pick = np.zeros(cand.shape, bool)
  pick[tuple(idx[perm].T)] = True
  return pick


def clip_cov_candidates(logp, old, adv, mask, k):
  """`m ∧ ¬(L2 > L1) ∧ lb < cov < ub`, computed in numpy (as the reference)."""
  rho = np.exp(np.clip(logp - old, -20, 20))
  lo, hi = 1 - k['clip_ratio_low'], 1 + k['clip_ratio_high']
  l1, l2 = -adv * rho, -adv * np.clip(rho, lo, hi)
  cov = (adv - adv[mask].mean()) * (logp - logp[mask].mean())
  return mask & ~(l2 > l1) & (cov > k['clip_cov_lb']) & (cov < k['clip_cov_ub'])


# ======================================================================= verl
#
# Cases: the `policy_loss` group (every registry loss × 5 loss_agg_modes ×
# with/without `is_weights_token_tis2`, plus `reinforce_direct/*`) and
# `policy_loss_global`. Excluded (not collected): every `bypass_mode` case
# (`ploss/bypass_mode/*`, `ploss_gbi/bypass_mode/*`). They run the rollout
# correction inside the loss and belong to the actor-objective tests. This
# includes `ploss/bypass_mode/bad_loss_type/*`, whose error is about
# `RolloutCorrectionConfig.loss_type='pg'` (a correction-config value), not a
# policy-loss name.
#
# verl's gspo, sapo and geo_mean ignore `loss_agg_mode` (D9): their golden is
# the natural mode, so those cases run with agg=None; `test_d9_*` asserts
# what jaxcorr does with an explicit agg.

VERL_IGNORES_AGG = ('gspo', 'sapo', 'geo_mean')


def _verl_selected(case):
  return 'bypass_mode' not in case['id']


VERL_CASES = [
  p
  for grp in ('policy_loss', 'policy_loss_global')
  for p in gd.case_params('verl', group=grp)
  if _verl_selected(p.values[0])
]


def verl_call(case):
  """Maps a verl policy-loss call to `policy_loss` arguments."""
  gs = gd.load('verl')
  kw = gs.kwargs(case)
  cfg = kw['config']
  pl = cfg['policy_loss']
  if case['id'].startswith('reinforce_direct/'):
    # compute_policy_loss_reinforce(rollout_log_prob, ...): REINFORCE whose
    # ppo_kl metric is taken against the rollout log-prob (bypass).
    name, old = 'reinforce', kw['rollout_log_prob']
  else:
    name, old = pl['loss_mode'], kw['old_log_prob']
  knobs = {
    k: cfg[k]
    for k in ('clip_ratio_low', 'clip_ratio_high', 'clip_ratio_c', 'tau_pos')
  }
  knobs['tau_neg'] = cfg['tau_neg']
  for k in ('clip_cov_ratio', 'clip_cov_lb', 'clip_cov_ub', 'kl_cov_ratio'):
    knobs[k] = pl[k]
  knobs.update(ppo_kl_coef=pl['ppo_kl_coef'], dro_beta=pl['dro_beta'])
  mask = kw['response_mask'].astype(bool)
  mode = kw['loss_agg_mode']
  # verl's agg_loss with global_batch_info divides by the global counts and
  # multiplies by dp_size (per-rank loss). jaxcorr has no dp multiplier, so the
  # same number is jaxcorr's loss with num_tokens = batch_num_tokens / dp,
  # num_seqs = global_batch_size / dp and norm = loss_scale_factor (the
  # seq-mean-token-sum-norm divisor); token-sum is then multiplied by dp.
  gbi = cfg.get('global_batch_info') or {}
  dp = gbi.get('dp_size') or 1
  n_tok, n_seq = gbi.get('batch_num_tokens'), gbi.get('global_batch_size')
  args = dict(
    name=name,
    old=old,
    adv=kw['advantages'],
    mask=mask,
    w=kw['rollout_is_weights'],
    agg=None if name in VERL_IGNORES_AGG else mode,
    num_tokens=None if n_tok is None else n_tok / dp,
    num_seqs=None if n_seq is None else n_seq / dp,
    norm=gbi.get('loss_scale_factor'),
    factor=dp if agg_lib.canonical_mode(mode) == 'token_sum' else 1,
    knobs=knobs,
    logp=kw['log_prob'],
    pick=None,
  )
  if name == 'clip_cov':
    cand = clip_cov_candidates(
      kw['log_prob'], old, kw['advantages'], mask, knobs
    )
    case = {**case, '_perm': gs.outputs(case)['randperm_used']}
    args['pick'] = pick_from_randperm(case, cand)
  return args


def _run_verl(a):
  def fn(lp):
    loss, met = policy.policy_loss(
      a['name'],
      lp,
      a['old'],
      a['adv'],
      a['mask'],
      is_weights=a['w'],
      agg=a['agg'],
      num_tokens=a['num_tokens'],
      num_seqs=a['num_seqs'],
      norm=a['norm'],
      clip_cov_pick=a['pick'],
      knobs=policy.check_knobs(a['knobs']),
    )
    return loss * a['factor'], met

  return value_grad(fn, a['logp'])


@pytest.mark.parametrize('case', VERL_CASES)
def test_verl_policy_loss(case):
  gs = gd.load('verl')
  a = verl_call(case)
  err = gs.error(case)
  if err is not None:
    # ploss/dro/beta_none_error: dro without dro_beta, verl's own message.
    assert a['name'] == 'dro' and a['knobs']['dro_beta'] is None
    with pytest.raises(ValueError, match=re.escape(err['message'])):
      _run_verl(a)
    return
  (loss, metrics), grad = _run_verl(a)
  out = gs.outputs(case)
  want_metrics = gs.metrics(case)
  ell = per_token(
    a['name'], a['logp'], a['old'], a['adv'], a['mask'], w=a['w'],
    clip_cov_pick=a['pick'], **a['knobs'],
  )  # fmt: skip
  mode = a['agg'] or policy.NATURAL_AGG[a['name']]
  abs_terms = a['factor'] * agg_lib.aggregate(
    jnp.abs(ell), a['mask'], mode, num_tokens=a['num_tokens'],
    num_seqs=a['num_seqs'], norm=a['norm'],
  )  # fmt: skip
  assert_loss(loss, out['loss'], abs_terms)
  assert_masked(grad, out['grad_log_prob'], a['mask'])
  assert set(metrics) == set(want_metrics)
  for k, v in want_metrics.items():
    np.testing.assert_allclose(metrics[k], v, rtol=RTOL, atol=ATOL, err_msg=k)


# --------------------------------------------------------------------- D9/D12


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
  return verl_call(case), gs.outputs(case)['loss']


@pytest.mark.parametrize('weighted', [False, True], ids=['now', 'w'])
@pytest.mark.parametrize('name', VERL_IGNORES_AGG)
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


# ====================================================================== SkyRL
#
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

  return value_grad(fn, a['logp'])


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
    cand = clip_cov_candidates(
      a['logp'], a['old'], a['adv'], a['mask'], a['knobs']
    )
    a['pick'] = pick_from_randperm(
      {**case, '_perm': out['randperm_used']}, cand
    )
  (loss, metrics), grad = _skyrl_loss(a, a['adv'], 'token_sum', rollout=rollout)
  assert_masked(grad, out['grad_cur_logprobs'], a['mask'])
  clip = out['metrics'].get('clip_ratio')
  mine = metrics.get('actor/pg_clipfrac', metrics.get('actor/prime_is_masked'))
  # With a correction, SkyRL's clip_ratio still counts over the original
  # loss_mask while its loss uses the corrected one; jaxcorr's metrics use
  # the corrected mask like every other term (D5), so only loss and
  # gradient are compared there.
  combo = '/combo_' in case['id']
  if clip is not None and mine is not None and not combo:
    np.testing.assert_allclose(mine, clip, rtol=RTOL, atol=ATOL)
  if not a['value_ok']:
    return  # dppo binary_kl: gradient and clip fraction only (see above)
  ell = per_token(
    a['name'], a['logp'], a['old'], a['adv'], a['mask'], rollout=rollout,
    clip_cov_pick=a.get('pick'), key=jax.random.key(0), **a['knobs'],
  )  # fmt: skip
  abs_terms = float(jnp.sum(jnp.where(a['mask'], jnp.abs(ell), 0)))
  assert_loss(loss, out['loss'], abs_terms)
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


# ====================================================================== slime
#
# slime works on packed samples: `flat_*` = row i truncated to lengths[i].
# They are unpacked to [B, T] with padding. `ppo_kl` = old − log_probs, so
# old_logp = flat_old_logprobs. Names: ppo → vanilla (eps_clip,
# eps_clip_high → clip_ratio_low/high, eps_clip_c → clip_ratio_c, None = no
# dual clip), cispo → cispo (its eps_clip bounds), gspo → gspo_seq. The
# gradient is that of Σ pg_losses·loss_mask, i.e. jaxcorr's token_sum.


def _unpack(flat, lengths, T):
  out = np.zeros((len(lengths), T), flat.dtype)
  start = 0
  for i, n in enumerate(lengths):
    out[i, :n] = flat[start : start + n]
    start += n
  return out


def _pack(x, lengths):
  return np.concatenate([np.asarray(x)[i, :n] for i, n in enumerate(lengths)])


def _packed_inputs(gs):
  data = gs.dataset()
  lengths = data['lengths']
  T = data['loss_mask'].shape[-1]
  return data, lengths, lambda v: _unpack(np.asarray(v), lengths, T)


@pytest.mark.parametrize('case', gd.case_params('slime', group='pl'))
def test_slime_policy_loss(case):
  gs = gd.load('slime')
  kw, out = gs.kwargs(case), gs.outputs(case)
  data, lengths, unpack = _packed_inputs(gs)
  fn_name = case['function']
  k = {'clip_ratio_low': kw['eps_clip'], 'clip_ratio_high': kw['eps_clip_high']}
  if 'gspo' in fn_name:
    name = 'gspo_seq'
  elif 'cispo' in fn_name:
    name = 'cispo'
  else:
    name = 'vanilla'
    k['clip_ratio_c'] = kw['eps_clip_c']
  if 'ppo_kl' in kw:  # slime's ppo_kl is exactly old − cur on these inputs
    np.testing.assert_array_equal(
      kw['ppo_kl'], data['flat_old_logprobs'] - data['flat_cur_logprobs']
    )
  logp = unpack(data['flat_cur_logprobs'])
  old = unpack(data['flat_old_logprobs'])
  adv = unpack(kw['advantages'])
  mask = unpack(data['flat_loss_mask']).astype(bool)
  flat_mask = data['flat_loss_mask'].astype(bool)

  def fn(lp):
    return policy.policy_loss(
      name, lp, old, adv, mask, agg='token_sum', knobs=policy.check_knobs(k)
    )

  (loss, metrics), grad = value_grad(fn, logp)
  ell = per_token(name, logp, old, adv, mask, **k)
  np.testing.assert_allclose(
    _pack(ell, lengths)[flat_mask], out['pg_losses'][flat_mask],
    rtol=RTOL, atol=ATOL,
  )  # fmt: skip
  abs_terms = float(np.sum(np.abs(out['pg_losses']) * flat_mask))
  assert_loss(loss, np.sum(out['pg_losses'] * flat_mask), abs_terms)
  np.testing.assert_allclose(
    _pack(grad, lengths)[flat_mask],
    out['grad_sum_masked_wrt_log_probs'][flat_mask],
    rtol=RTOL,
    atol=ATOL,
  )
  np.testing.assert_allclose(
    metrics['actor/pg_clipfrac'], out['clipfrac'][flat_mask].mean(), rtol=RTOL
  )


# ================================================================== prime-rl
#
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
  _, lengths, unpack = _packed_inputs(gs)
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
    lambda lp, a, m, r: per_token(
      name, lp[None], None, a[None], m[None], rollout=r[None], **knobs
    )
  )(logp, adv, mask, roll)
  abs_terms = np.abs(np.asarray(ell)).reshape(len(lengths), -1).sum(-1)
  for i, want in enumerate(out['per_sample_loss']):
    assert_loss(per[i], want, abs_terms[i])
  np.testing.assert_allclose(
    _pack(grad, lengths), out['grad_trainer_logprobs'], rtol=RTOL, atol=ATOL
  )
  if name == 'prime':
    for theirs, ours in PRIME_METRICS.items():
      np.testing.assert_allclose(
        metrics[ours], out[theirs], rtol=1e-5, atol=ATOL, err_msg=theirs
      )


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
  _, lengths, unpack = _packed_inputs(gs)
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
  np.testing.assert_allclose(
    metrics['actor/prime_unmasked_mismatch_kl'], want, rtol=1e-5, atol=ATOL
  )
  np.testing.assert_array_equal(metrics['actor/prime_is_masked'], 0.0)
