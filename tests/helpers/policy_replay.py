"""Calls of the policy losses and the golden layouts their replays share
(tests/conformance/*/test_policy.py and the divergences).

Tolerances (docs/math/README.md §6): rtol = atol = 1e-6 in float32; for sums
(token_sum, seq_mean_token_sum, the SkyRL, slime and prime-rl sums) the atol
is scaled by the same aggregation of |ℓ| (`assert_close(..., scale=...)`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcorr.losses import aggregate as agg_lib
from jaxcorr.losses import policy
from jaxcorr.losses.policy import LossInputs
from tests.helpers import golden_data as gd


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


# verl's gspo, sapo and geo_mean ignore `loss_agg_mode` (D9): their golden is
# the natural mode, so those cases run with agg=None; `test_d9_*` asserts
# what jaxcorr does with an explicit agg.
VERL_IGNORES_AGG = ('gspo', 'sapo', 'geo_mean')


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


def _unpack(flat, lengths, T):
  """slime's packed layout -> `[B, T]` rows padded with zeros."""
  out = np.zeros((len(lengths), T), flat.dtype)
  start = 0
  for i, n in enumerate(lengths):
    out[i, :n] = flat[start : start + n]
    start += n
  return out


def pack(x, lengths):
  """`[B, T]` rows -> slime's packed layout (row i cut to lengths[i])."""
  return np.concatenate([np.asarray(x)[i, :n] for i, n in enumerate(lengths)])


def packed_inputs(gs):
  """A packed golden set's dataset, its lengths, and packed -> `[B, T]`."""
  data = gs.dataset()
  lengths = data['lengths']
  T = data['loss_mask'].shape[-1]
  return data, lengths, lambda v: _unpack(np.asarray(v), lengths, T)
