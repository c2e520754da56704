"""Golden parity of advantages, reward placement, KL in reward, controllers.

Replays every advantage / KL-in-reward / controller / reward-placement case
of the golden set (README "What the cases cover"):

* verl `advantage`, `kl_in_reward`, `kl_controller`;
* SkyRL `adv`, `kl_ctrl`, `util`;
* slime `rewards`, `adv`, `bug2114`, `gae`, `util`;
* prime-rl `head/advantage`, `legacy/advantage`.

Values are compared on valid positions at rtol = atol = 1e-6 (float32), and
jaxcorr's outputs must be exactly 0 outside the mask (D13). A case is skipped
only when its function is outside the spec (verl's optimal-token baselines,
slime's on-policy distillation, prime-rl's length penalty, RAE and
hierarchical GRPO) or when it records a documented divergence, which then
has its own test at the end of this file asserting jaxcorr's value on the
reference's inputs (D4, D6, D12, D13, D15, the SkyRL and slime recursions
over padding and tool-output holes, and the slime #2114 KL aliasing).

Argument mapping: verl `index` strings and slime/prime groups become dense
int32 group ids; SkyRL/slime float masks become bool; slime's packed samples
are unpacked to `[B, T]` rows with `lengths` (left-aligned) and compared on
each sample's own tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxcorr.losses import advantages as adv_lib
from jaxcorr.losses import kl as kl_lib
from jaxcorr.losses import masked
from jaxcorr.losses import rewards as rw
from tests.helpers import golden_data as gd

RTOL = ATOL = 1e-6


def _close(got, exp, mask=None, rtol=RTOL, atol=ATOL, what=''):
  got = np.asarray(got, np.float64)
  exp = np.asarray(exp, np.float64)
  if mask is not None:
    got, exp = got[mask], exp[mask]
  np.testing.assert_allclose(got, exp, rtol=rtol, atol=atol, err_msg=what)


def _zero_outside(x, mask):
  x = np.asarray(x)
  assert (x[~mask] == 0).all(), 'non-zero outside the mask (D13)'


def _ids(index) -> np.ndarray:
  """Group labels (strings or ints) → dense int32 ids in [0, B)."""
  return np.unique(np.asarray(index), return_inverse=True)[1].astype(np.int32)


def _cfg(node: dict) -> dict:
  return {k: v for k, v in node.items() if k != '$config'}


def _run(estimator, rewards, mask, ids=None, **kw):
  a, r = adv_lib.compute_advantages(estimator, rewards, mask, ids, **kw)
  _zero_outside(a, mask)
  _zero_outside(r, mask)
  return np.asarray(a), np.asarray(r)


# ===================================================================== verl

VERL_ALIASES = {'grpo_vectorized': 'grpo', 'rloo_vectorized': 'rloo'}
VERL_OUT_OF_SCOPE = {
  'optimal_token_baseline': (
    'verl optimal_token_baseline is not an estimator of '
    'docs/math/advantages.md §4 (it needs the model-side sum_pi_squared per '
    'token)'
  ),
  'tir_optimal_token_baseline': (
    'verl tir_optimal_token_baseline is not an estimator of '
    'docs/math/advantages.md §4 (it needs the model-side sum_pi_squared per '
    'token)'
  ),
}


def _verl_main():
  d = gd.load('verl').dataset()
  return d, d['response_mask'] > 0, _ids(d['index'])


@pytest.mark.parametrize('case', gd.case_params('verl', group='advantage'))
def test_verl_advantage(case):
  name = case['id'].split('/')[1]
  if name in VERL_OUT_OF_SCOPE:
    pytest.skip(VERL_OUT_OF_SCOPE[name])
  gs = gd.load('verl')
  kw, out = gs.kwargs(case), gs.outputs(case)
  _, m, ids = _verl_main()
  algo = kw.get('config') or {}
  norm = kw.get(
    'norm_adv_by_std_in_grpo', algo.get('norm_adv_by_std_in_grpo', True)
  )
  if name == 'gdpo':
    # Not a spec estimator: with the single reward dimension stored here,
    # verl's GDPO is whiten(grpo) over the batch; rebuilt from jaxcorr's
    # public grpo and whiten.
    a, _ = _run('grpo', kw['token_level_rewards'], m, ids, norm_adv_by_std=norm)
    a = adv_lib.whiten(a, m)
    _close(a, out['advantages'], m)
    _close(a, out['returns'], m)
    return
  a, r = _run(
    VERL_ALIASES.get(name, name),
    kw['token_level_rewards'],
    m,
    ids,
    values=kw.get('values'),
    gamma=kw.get('gamma', algo.get('gamma', 1.0)),
    lam=kw.get('lam', algo.get('lam', 1.0)),
    norm_adv_by_std=norm,
    reward_baselines=kw.get('reward_baselines'),
  )
  _close(a, out['advantages'], m, what='advantages')
  _close(r, out['returns'], m, what='returns')


@pytest.mark.parametrize('case', gd.case_params('verl', group='kl_in_reward'))
def test_verl_kl_in_reward(case):
  gs = gd.load('verl')
  kw, out = gs.kwargs(case), gs.outputs(case)
  batch = kw['data.batch']
  m = batch['response_mask'] > 0
  cfg = rw.KLControlConfig(**_cfg(kw['kl_ctrl']))
  state = rw.init_kl_controller(cfg)
  rewards, kl, metrics = rw.apply_kl_penalty(
    batch['token_level_scores'],
    batch['old_log_probs'],
    batch['ref_log_prob'],
    m,
    state.coef,
    estimator=kw['kl_penalty'],
  )
  _close(rewards, out['token_level_rewards'], m)
  _zero_outside(rewards, m)
  expected_kl = kl_lib.kl_penalty(
    batch['old_log_probs'], batch['ref_log_prob'], kw['kl_penalty'], mask=m
  )
  np.testing.assert_array_equal(np.asarray(kl), np.asarray(expected_kl))
  assert set(metrics) == set(case['metrics'])
  for key, value in case['metrics'].items():
    _close(metrics[key], value, what=key)
  new = rw.update_kl_controller(
    state, metrics[rw.KL_METRIC], kw['n_steps(batch_size)'], cfg
  )
  _close(new.coef, out['kl_coef_after_update'], what='kl_coef_after_update')


@pytest.mark.parametrize('case', gd.case_params('verl', group='kl_controller'))
def test_verl_kl_controller_trajectory(case):
  kw = gd.load('verl').kwargs(case)
  cfg = rw.KLControlConfig(
    type='adaptive',
    kl_coef=kw['init_kl_coef'],
    target_kl=kw['target_kl'],
    horizon=kw['horizon'],
  )
  state, got = rw.init_kl_controller(cfg), []
  for current in kw['current_kl_sequence']:
    state = rw.update_kl_controller(state, current, kw['n_steps'], cfg)
    got.append(float(state.coef))
  _close(got, gd.load('verl').outputs(case)['kl_coef_trajectory'])


# ==================================================================== SkyRL

SKYRL_ESTIMATORS = {'reinforce++': 'reinforce_plus_plus'}


@pytest.mark.parametrize('case', gd.case_params('skyrl', group='adv'))
def test_skyrl_advantage(case):
  if case['id'] == 'adv/gae_g0.99_l0.95':
    pytest.skip(
      'D13: SkyRL recurses over the values left in the padding after a '
      'left-aligned response; jaxcorr skips padding. Asserted in '
      'test_d13_skyrl_gae_reads_left_padding'
    )
  gs = gd.load('skyrl')
  kw, out = gs.kwargs(case), gs.outputs(case)
  m = kw['response_mask'] > 0
  name = SKYRL_ESTIMATORS.get(kw['adv_estimator'], kw['adv_estimator'])
  a, r = _run(
    name,
    kw['token_level_rewards'],
    m,
    _ids(kw['index']),
    values=kw.get('values'),
    gamma=kw.get('gamma', 1.0),
    lam=kw.get('lambd', 1.0),
    norm_adv_by_std=kw.get('grpo_norm_by_std', True),
  )
  _close(a, out['advantages'], m, what='advantages')
  _close(r, out['returns'], m, what='returns')


@pytest.mark.parametrize('case', gd.case_params('skyrl', group='kl_ctrl'))
def test_skyrl_kl_controller(case):
  gs = gd.load('skyrl')
  kw = gs.kwargs(case)
  cfg = rw.KLControlConfig(
    type='adaptive',
    kl_coef=kw['init_kl_coef'],
    target_kl=kw['target'],
    horizon=kw['horizon'],
  )
  state, got = rw.init_kl_controller(cfg), []
  for current, n_steps in kw['updates']:
    state = rw.update_kl_controller(state, current, n_steps, cfg)
    got.append(float(state.coef))
  _close(got, gs.outputs(case)['values_after_each_update'])


@pytest.mark.parametrize('case', gd.case_params('skyrl', group='util'))
def test_skyrl_util(case):
  gs = gd.load('skyrl')
  kw, out = gs.kwargs(case), gs.outputs(case)['out']
  if case['id'] == 'util/safe_exp_delta':
    _close(masked.exp_clamped(kw['delta']), out)
    return
  m = kw['mask'] > 0
  if case['id'] == 'util/masked_whiten':
    _close(adv_lib.whiten(kw['values'], m), out, m)
  else:
    _close(adv_lib.masked_var(kw['values'], m), out)


# ==================================================================== slime


def _slime_rows(gs):
  """Per-sample lengths, the [B, T] response and loss masks, rewards, ids."""
  d = gs.dataset()
  lengths = d['lengths']
  b, t = len(lengths), d['response_mask'].shape[1]
  resp = np.arange(t)[None, :] < lengths[:, None]
  loss = _unpack(d['flat_loss_mask'], lengths, t) > 0
  batch = gs.index['datasets']['main']['batch']
  rewards = np.asarray(batch['rewards'], np.float32)
  n = 4  # n_samples_per_prompt: consecutive groups (README, slime rewards)
  ids = (np.arange(b) // n * n).astype(np.int32)
  return lengths, resp, loss, rewards, ids


def _unpack(flat, lengths, t) -> np.ndarray:
  out = np.zeros((len(lengths), t), np.asarray(flat).dtype)
  for i, row in enumerate(np.split(flat, np.cumsum(lengths)[:-1])):
    out[i, : len(row)] = row
  return out


def _rows(items, t) -> np.ndarray:
  out = np.zeros((len(items), t), np.float32)
  for i, row in enumerate(items):
    out[i, : len(row)] = row
  return out


SLIME_SKIP = {
  'adv/grpo_opd': (
    "slime's on-policy distillation term (use_opd, teacher log-probs) is not "
    'part of docs/math/advantages.md'
  ),
}
SLIME_HOLE_RECURSION = {
  # slime runs GAE / discounted returns over every response position, the
  # tool-output hole of row 3 included (and for ppo with the hole's KL in
  # the reward); jaxcorr skips the hole. Same value whenever the hole's
  # rewards are 0 and γ = λ = 1.
  'adv/ppo_kl0.05_k1_g1_l1',
  'adv/ppo_kl0.05_k3_g0.99_l0.95',
  'adv/ppo_kl0.05_k1_normadv',
  'adv/reinforce_plus_plus_kl0.05_g0.99',
}


def _slime_pipeline(kw, resp, loss, rewards, ids, t):
  """jaxcorr's step for one slime `compute_advantages_and_returns` case."""
  est = kw['advantage_estimator']
  behaviour = kw['rollout_log_probs'] if kw['use_rollout_logprobs'] else None
  if behaviour is None:
    behaviour = kw['log_probs']
  lengths = resp.sum(-1)
  old = _unpack(behaviour, lengths, t)
  ref = _unpack(kw['ref_log_probs'], lengths, t)
  scores = rw.place_at_last_token(rewards, loss)
  shaped, kl, _ = rw.apply_kl_penalty(
    scores, old, ref, loss, kw['kl_coef'], estimator=kw['kl_loss_type']
  )
  norm = kw['normalize_advantages']
  if est in ('grpo', 'gspo', 'cispo'):
    a, r = _run('grpo', scores, loss, ids)
    return (adv_lib.whiten(a, loss) if norm else a), r, kl
  if est == 'ppo':
    values = _unpack(kw['values'], lengths, t)
    a, r = _run(
      'gae', shaped, loss, values=values, gamma=kw['gamma'], lam=kw['lambd']
    )
    g = np.where(loss, r - values, 0)  # un-whitened G = returns − values
    return (a if norm else g), r, kl
  if est == 'reinforce_plus_plus':
    a, r = _run('reinforce_plus_plus', shaped, loss, gamma=kw['gamma'])
    return (a if norm else r), r, kl
  # slime's reinforce_plus_plus_baseline is per token, without returns:
  # (r_i − μ_g) − β·kl_t, whitened. jaxcorr's estimator of that name is
  # verl's (test_slime_rf_baseline_is_not_verls); the slime recipe is
  # rebuilt from jaxcorr's grpo (centring), the returned kl and whiten.
  centred, _ = _run('grpo', scores, loss, ids, norm_adv_by_std=False)
  tok = np.where(loss, centred - kw['kl_coef'] * np.asarray(kl), 0)
  return np.asarray(adv_lib.whiten(tok, loss)), tok, kl


@pytest.mark.parametrize('case', gd.case_params('slime', group='adv'))
def test_slime_advantage(case):
  if case['id'] in SLIME_SKIP:
    pytest.skip(SLIME_SKIP[case['id']])
  gs = gd.load('slime')
  kw, out = gs.kwargs(case), gs.outputs(case)
  lengths, resp, loss, rewards, ids = _slime_rows(gs)
  # The sequence rewards slime's estimator received, post-processed by
  # `_post_process_rewards` (group-normalised for the GRPO family).
  seq = _slime_sequence_values(
    kw['advantage_estimator'], True, True, rewards, resp, ids
  )
  _close(seq, out['rewards_in'], what='rewards_in')
  t = resp.shape[1]
  a, r, kl = _slime_pipeline(kw, resp, loss, rewards, ids, t)
  exp_a, exp_r = _rows(out['advantages'], t), _rows(out['returns'], t)
  if kw['kl_coef'] > 0 or kw['use_rollout_logprobs']:
    _close(kl, _rows(out['kl_stored'], t), loss, what='kl')
  else:
    # slime does not compute the KL when it is off (kl_stored = 0); jaxcorr
    # does not apply it then (test_slime_bug2114_raw_kl_is_kept covers the
    # logged KL).
    assert all((x == 0).all() for x in out['kl_stored'])
  cmp = loss
  if case['id'] in SLIME_HOLE_RECURSION:
    cmp = loss & loss.all(-1, where=resp, keepdims=True)  # rows w/o a hole
    assert cmp.sum(-1).astype(bool).sum() == 7
    if kw['normalize_advantages']:
      # Whitening mixes every row with row 3: compare the un-whitened
      # returns on the other rows, and jaxcorr's whiten applied to slime's
      # own un-whitened advantages with slime's normalised ones.
      _close(r, exp_r, cmp, what='returns')
      slime_g = exp_r
      if kw['advantage_estimator'] == 'ppo':
        slime_g = exp_r - _unpack(kw['values'], lengths, t)
      _close(adv_lib.whiten(slime_g, loss), exp_a, loss, what='whiten')
      return
  _close(a, exp_a, cmp, what='advantages')
  _close(r, exp_r, cmp, what='returns')


def _slime_sequence_values(est, norm, std, rewards, resp, ids):
  """The per-sample reward slime's estimator sees, computed by jaxcorr."""
  scores = rw.place_at_last_token(rewards, resp)
  last = np.asarray(rw.last_token_index(resp))
  rows = np.arange(len(rewards))
  if not norm or est in ('reinforce_plus_plus', 'ppo'):
    # No group normalisation: placement keeps the reward as the score s_i.
    return np.asarray(masked.row_sum(scores, resp))
  by_std = std and est != 'reinforce_plus_plus_baseline'
  a, _ = _run('grpo', scores, resp, ids, norm_adv_by_std=by_std)
  return a[rows, last]


@pytest.mark.parametrize('case', gd.case_params('slime', group='rewards'))
def test_slime_reward_post_processing(case):
  gs = gd.load('slime')
  kw, out = gs.kwargs(case), gs.outputs(case)
  _, resp, _, _, ids = _slime_rows(gs)
  rewards = np.asarray(kw['raw_rewards'], np.float32)
  got = _slime_sequence_values(
    kw['advantage_estimator'],
    kw['rewards_normalization'],
    kw['grpo_std_normalization'],
    rewards,
    resp,
    ids,
  )
  _close(got, out['rewards'])


@pytest.mark.parametrize('case', gd.case_params('slime', group='gae'))
def test_slime_gae(case):
  gs = gd.load('slime')
  kw, out = gs.kwargs(case), gs.outputs(case)
  lengths, resp, *_ = _slime_rows(gs)
  t = resp.shape[1]
  values = _unpack(kw['values'], lengths, t)
  rewards = _unpack(kw['rewards'], lengths, t)
  _, r = _run(
    'gae',
    rewards,
    resp,
    values=values,
    gamma=kw['gamma'],
    lam=kw['lambd'],
  )
  _close(r, _rows(out['returns'], t), resp, what='returns')
  g = np.where(resp, r - values, 0)
  _close(g, _rows(out['advantages'], t), resp, what='advantages')


@pytest.mark.parametrize('case', gd.case_params('slime', group='util'))
def test_slime_util(case):
  gs = gd.load('slime')
  kw, out = gs.kwargs(case), gs.outputs(case)
  if case['id'].startswith('util/chunked_discounted_returns'):
    _, resp, *_ = _slime_rows(gs)
    _, r = _run(
      'reinforce_plus_plus', kw['rewards'], resp, gamma=kw['discount']
    )
    _close(r, out['returns'], resp)
    return
  m = kw['mask'][None] > 0
  _close(adv_lib.whiten(kw['values'][None], m), out['out'][None], m)


@pytest.mark.parametrize('case', gd.case_params('slime', group='bug2114'))
def test_slime_bug2114_raw_kl_is_kept(case):
  """The #2114 scenario: jaxcorr's returned KL is the raw KL, never aliased.

  Before the fix slime stored `−β·kl` plus the reward at the last token as
  "kl"; with β = 0 the log showed the reward. jaxcorr returns the raw KL
  (an independent `kl_penalty`) for every β, and its advantages/returns
  are slime's after the fix.
  """
  gs = gd.load('slime')
  kw, out = gs.kwargs(case), gs.outputs(case)
  lengths, resp, _, rewards, _ = _slime_rows(gs)
  t = resp.shape[1]
  old = _unpack(kw['log_probs'], lengths, t)
  ref = _unpack(kw['ref_log_probs'], lengths, t)
  values = _unpack(kw['values'], lengths, t)
  scores = rw.place_at_last_token(rewards, resp)
  scores_before = np.asarray(scores).copy()
  beta = kw['kl_coef']
  shaped, kl, _ = rw.apply_kl_penalty(
    scores, old, ref, resp, beta, estimator=kw['kl_loss_type']
  )
  np.testing.assert_array_equal(np.asarray(scores), scores_before)
  raw = kl_lib.kl_penalty(old, ref, kw['kl_loss_type'], mask=resp)
  np.testing.assert_array_equal(np.asarray(kl), np.asarray(raw))
  assert np.abs(np.asarray(kl)[resp]).max() > 1e-3  # log-probs differ
  before = _rows(out['kl_stored_before_fix'], t)
  assert not np.allclose(np.asarray(kl)[resp], before[resp], atol=1e-3)
  if beta > 0:
    _close(kl, _rows(out['raw_kl'], t), resp, what='raw_kl')
    _close(kl, _rows(out['kl_stored_after_fix'], t), resp, what='after fix')
  else:
    # slime skips the KL when β = 0 (raw_kl = 0): its pre-fix log was the
    # placed reward itself. jaxcorr's token rewards are the scores.
    _close(before, scores_before, resp, what='pre-fix log = reward')
    np.testing.assert_array_equal(np.asarray(shaped), scores_before)
  _, r = _run(
    'gae', shaped, resp, values=values, gamma=kw['gamma'], lam=kw['lambd']
  )
  _close(r, _rows(out['returns_after_fix'], t), resp, what='returns')
  g = np.where(resp, r - values, 0)
  _close(g, _rows(out['advantages_after_fix'], t), resp, what='advantages')


# =================================================================== prime

PRIME_SKIP = {
  'head/advantage/grpo_length_penalty': (
    "prime-rl's optional length penalty is out of scope "
    '(docs/math/advantages.md §4)'
  ),
  'head/advantage/rae': (
    "prime-rl's RAE baseline is stateful across calls (final_baselines); "
    'not an estimator of docs/math/advantages.md §4'
  ),
  'head/advantage/hierarchical_grpo': (
    "prime-rl's hierarchical (proposer/solver) GRPO is not an estimator of "
    'docs/math/advantages.md §4'
  ),
}


def _prime_batch(rewards, lengths):
  rewards = np.asarray(rewards, np.float32)
  lengths = np.asarray(lengths)
  t = int(lengths.max())
  mask = np.arange(t)[None, :] < lengths[:, None]
  return rewards, mask, rw.place_at_last_token(rewards, mask)


@pytest.mark.parametrize(
  'case',
  [
    *gd.case_params('prime', group='head/advantage'),
    *gd.case_params('prime', group='legacy/advantage'),
  ],
)
def test_prime_advantage(case):
  if case['id'] in PRIME_SKIP:
    pytest.skip(PRIME_SKIP[case['id']])
  gs = gd.load('prime')
  kw, out = gs.kwargs(case), gs.outputs(case)
  n = len(kw['rewards'])
  lengths = kw.get('num_output_tokens', kw.get('completion_lengths', [1] * n))
  _, mask, scores = _prime_batch(kw['rewards'], lengths)
  size = kw.get('samples_per_problem', 4)
  ids = (np.arange(n) // size * size).astype(np.int32)
  if 'groups' in kw:
    ids = np.zeros(n, np.int32)
    for g in kw['groups']:
      ids[g] = g[0]
  if 'max_rl' in case['id']:
    # prime-rl's max_rl divides by the group mean without an ε.
    a, _ = _run('maxrl', scores, mask, ids, eps=0.0)
  elif kw.get('length_weighted_mean'):
    a, _ = _run('opo', scores, mask, ids)  # length-weighted baseline
  else:
    a, _ = _run('grpo', scores, mask, ids, norm_adv_by_std=False)
  per_row = a[np.arange(n), np.asarray(rw.last_token_index(mask))]
  key = 'advantages' if 'advantages' in out else 'advantage_per_trace'
  _close(per_row, out[key], what=key)
  if 'token_advantages' in out:
    _close(a[mask], out['token_advantages'], what='token_advantages')


# ============================================================= divergences


def test_d6_reward_in_padding_is_ignored():
  """verl's GRPO-family scores sum every position; jaxcorr valid tokens only.

  A reward of 5 left on a padded position of row 1 (length 27) moves verl's
  score of row 1 and with it group g0's mean and std; jaxcorr's advantages
  stay those of the golden (clean) batch.
  """
  gs = gd.load('verl')
  d, m, ids = _verl_main()
  dirty = d['token_level_rewards'].copy()
  assert not m[1, 30]
  dirty[1, 30] = 5.0
  case = gs.case('adv/grpo/default/main')
  for name in ('grpo', 'rloo', 'opo', 'gpg', 'grpo_passk', 'maxrl'):
    clean, _ = _run(name, d['token_level_rewards'], m, ids)
    got, _ = _run(name, dirty, m, ids)
    np.testing.assert_array_equal(got, clean)
  got, _ = _run('grpo', dirty, m, ids)
  _close(got, gs.outputs(case)['advantages'], m)
  # verl's score of row 1 would be 5: its group g0 = [1, 5, 0, 1].
  s = dirty.sum(-1)[:4].astype(np.float64)
  verl_row1 = (s[1] - s.mean()) / (s.std(ddof=1) + 1e-6)
  assert abs(verl_row1 - got[1, 0]) > 0.5


def test_d12_empty_row_is_not_a_group_member():
  """verl counts an empty row as a member with score 0; jaxcorr drops it."""
  d, m, ids = _verl_main()
  m = m.copy()
  m[5] = False  # row 5 (group g1) becomes empty
  r = d['token_level_rewards']
  s = (r * m).sum(-1).astype(np.float64)
  members = [4, 6, 7]
  mu, sd = s[members].mean(), s[members].std(ddof=1)
  a, _ = _run('grpo', r, m, ids)
  assert (a[5] == 0).all()
  for i in members:
    _close(a[i][m[i]], np.full(m[i].sum(), (s[i] - mu) / (sd + 1e-6)))
  # GPG's α counts non-empty rows: |V| = 7, 5 of them with s ≠ 0.
  a, _ = _run('gpg', r, m, ids)
  alpha = 7 / np.count_nonzero(s[m.any(-1)])
  _close(a[4][m[4]], np.full(m[4].sum(), alpha * (s[4] - mu)))
  assert (a[5] == 0).all()


def test_d12_whitening_fewer_than_two_tokens_only_centres():
  """verl raises on < 2 valid tokens; jaxcorr centres (0 for one token)."""
  x = np.array([[3.0, 7.0, -1.0]], np.float32)
  one = np.array([[False, True, False]])
  np.testing.assert_array_equal(np.asarray(adv_lib.whiten(x, one)), 0.0)
  none = np.zeros_like(one)
  np.testing.assert_array_equal(np.asarray(adv_lib.whiten(x, none)), 0.0)
  for name in ('reinforce_plus_plus', 'reinforce_plus_plus_baseline', 'gae'):
    a, _ = _run(
      name, x, one, np.zeros(1, np.int32), values=np.ones_like(x), lam=0.95
    )
    np.testing.assert_array_equal(a, 0.0)


def test_d12_grpo_passk_singleton_gets_zero():
  """verl raises on a group with one sample; jaxcorr gives it 0."""
  r = np.zeros((3, 4), np.float32)
  r[:, -1] = [1.0, 0.25, 0.75]
  m = np.ones((3, 4), bool)
  a, _ = _run('grpo_passk', r, m, np.array([0, 1, 1], np.int32))
  assert (a[0] == 0).all()
  # Group 1: best row 2 gets (0.75 − 0.25)/(σ + ε).
  _close(a[2], np.full(4, 0.5 / (np.std([0.25, 0.75], ddof=1) + 1e-6)))
  assert (a[1] == 0).all()


def test_d13_outputs_are_zero_outside_the_mask():
  """verl leaves values in the padding (e.g. gae returns = G + values)."""
  gs = gd.load('verl')
  d, m, ids = _verl_main()
  exp = gs.outputs(gs.case('adv/gae/g0.99_l0.95/main'))['returns']
  assert np.abs(exp[~m]).max() > 0.1  # the reference's padding values
  for name in adv_lib.ESTIMATORS:
    _run(  # asserts exact zeros outside the mask
      name,
      d['token_level_rewards'],
      m,
      ids,
      values=d['values'],
      gamma=0.99,
      lam=0.95,
      reward_baselines=d['reward_baselines'],
    )


def test_d13_skyrl_gae_reads_left_padding():
  """SkyRL's GAE recurses over padded values (left-aligned, γλ < 1).

  jaxcorr skips padding, so its result does not depend on the alignment:
  on the left-aligned batch it equals SkyRL's own right-aligned golden
  (SkyRL's real layout, unaffected) rolled back, while SkyRL's left-aligned
  golden differs by up to 0.32 in the returns.
  """
  gs = gd.load('skyrl')
  left = gs.case('adv/gae_g0.99_l0.95')
  right = gs.case('adv/gae_g0.99_l0.95/right_aligned')
  kw = gs.kwargs(left)
  m = kw['response_mask'] > 0
  a, r = _run(
    'gae',
    kw['token_level_rewards'],
    m,
    values=kw['values'],
    gamma=0.99,
    lam=0.95,
  )
  lengths = m.sum(-1)
  t = m.shape[1]
  out_r = gs.outputs(right)
  back = {
    k: np.stack([np.roll(row, -(t - n)) for row, n in zip(v, lengths)])
    for k, v in out_r.items()
  }
  _close(a, back['advantages'], m)
  _close(r, back['returns'], m)
  exp_left = gs.outputs(left)['returns']
  diff = np.abs(r - exp_left)[m].max()
  assert 0.3 < diff < 0.33


def test_d15_rejected_member_stays_in_the_baseline():
  """verl decoupled feeds the RS mask to the estimators; jaxcorr does not.

  Row 2 is rejected by RS. jaxcorr computes the advantages on the mask
  before rejection, so every other row keeps the golden GRPO value; with the
  RS mask reaching the estimator (verl), row 2 would become empty and group
  g0's statistics would change. Whitened estimators change everywhere.
  """
  gs = gd.load('verl')
  d, m, ids = _verl_main()
  r = d['token_level_rewards']
  rs_mask = m.copy()
  rs_mask[2] = False
  ours, _ = _run('grpo', r, m, ids)
  _close(ours, gs.outputs(gs.case('adv/grpo/default/main'))['advantages'], m)
  theirs, _ = _run('grpo', r, rs_mask, ids)
  assert not np.allclose(ours[0][m[0]], theirs[0][m[0]])
  ours_w, _ = _run('reinforce_plus_plus_baseline', r, m, ids)
  theirs_w, _ = _run('reinforce_plus_plus_baseline', r, rs_mask, ids)
  assert not np.allclose(ours_w[7][m[7]], theirs_w[7][m[7]])


def test_d4_kl_metric_averages_non_empty_rows():
  """verl averages the per-row KL over all B rows; jaxcorr over V."""
  d, m, _ = _verl_main()
  m = m.copy()
  m[5] = False
  old, ref = d['old_log_prob'], d['ref_log_prob']
  _, _, metrics = rw.apply_kl_penalty(
    d['token_level_rewards'], old, ref, m, 0.05
  )
  per_row = np.where(m, old - ref, 0).sum(-1) / np.maximum(m.sum(-1), 1)
  ours = per_row[m.any(-1)].mean()
  verl = per_row.mean()  # an empty row adds a 0 to verl's mean
  _close(metrics[rw.KL_METRIC], ours, rtol=1e-5)
  assert abs(ours - verl) > 1e-4


def _compact_row(x, keep):
  """The valid entries of one row, left-aligned in a row of the same T."""
  out = np.zeros_like(x)
  out[: keep.sum()] = x[keep]
  return out


@pytest.mark.parametrize(
  'case_id',
  ['adv/ppo_kl0.05_k3_g0.99_l0.95', 'adv/reinforce_plus_plus_kl0.05_g0.99'],
)
def test_slime_recursion_over_tool_hole(case_id):
  """slime recurses across row 3's tool-output hole; jaxcorr skips it.

  jaxcorr's row 3 equals the same row with the hole cut out (the spec's
  "as if it were not there"); slime's golden differs there.
  """
  gs = gd.load('slime')
  kw, out = gs.kwargs(gs.case(case_id)), gs.outputs(gs.case(case_id))
  lengths, resp, loss, rewards, ids = _slime_rows(gs)
  t = resp.shape[1]
  _, r, _ = _slime_pipeline(kw, resp, loss, rewards, ids, t)
  hole = loss[3]
  assert (~hole[: lengths[3]]).sum() == 4
  n = int(hole.sum())
  one = np.arange(t)[None, :] < n
  packed = ('log_probs', 'ref_log_probs', 'values', 'rollout_log_probs')
  flat = {
    k: _unpack(v, lengths, t)[3][hole] if k in packed else v
    for k, v in kw.items()
  }
  _, r_cut, _ = _slime_pipeline(
    flat, one, one, rewards[3:4], np.zeros(1, np.int32), t
  )
  _close(r[3][hole], r_cut[0][:n])
  exp = _rows(out['returns'], t)[3]
  assert np.abs(exp[hole] - r[3][hole]).max() > 1e-3


def test_slime_rf_baseline_is_not_verls():
  """slime's reinforce_plus_plus_baseline ≠ jaxcorr's (verl's,
  docs/math/advantages.md §4).

  verl whitens the group-centred *sequence* score `(s_i − μ_g)·m` (the KL
  shaping summed into s_i); slime whitens `(r_i − μ_g) − β·kl_t` per token.
  """
  gs = gd.load('slime')
  case = gs.case('adv/reinforce_plus_plus_baseline_kl0.05')
  kw, out = gs.kwargs(case), gs.outputs(case)
  lengths, resp, loss, rewards, ids = _slime_rows(gs)
  t = resp.shape[1]
  scores = rw.place_at_last_token(rewards, loss)
  old = _unpack(kw['log_probs'], lengths, t)
  ref = _unpack(kw['ref_log_probs'], lengths, t)
  shaped, _, _ = rw.apply_kl_penalty(scores, old, ref, loss, 0.05)
  ours, _ = _run('reinforce_plus_plus_baseline', shaped, loss, ids)
  # jaxcorr: constant over each row's tokens, whitened over the batch.
  for i in range(len(lengths)):
    assert np.ptp(ours[i][loss[i]]) < 1e-6
  exp = _rows(out['advantages'], t)
  assert np.abs(ours - exp)[loss].max() > 1e-2


def test_rloo_singleton_keeps_its_score():
  """verl `rloo` keeps s_i for a singleton; SkyRL and rloo_vectorized give 0.

  The SkyRL singleton golden agrees only because that row's reward is 0.
  """
  r = np.zeros((3, 2), np.float32)
  r[:, -1] = [0.5, 1.0, 0.0]
  m = np.ones((3, 2), bool)
  a, _ = _run('rloo', r, m, np.array([0, 1, 1], np.int32))
  _close(a[0], [0.5, 0.5])
  a, _ = _run('maxrl', r, m, np.array([0, 1, 1], np.int32))
  _close(a[0], [0.5, 0.5])
