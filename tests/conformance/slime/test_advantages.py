"""Rewards, advantages, GAE and utilities against slime's goldens
(`rewards`, `adv`, `bug2114`, `gae`, `util`).

slime's packed samples are unpacked to `[B, T]` rows and compared on each
sample's own tokens at rtol = atol = 1e-6. Skipped: slime's on-policy
distillation (outside the spec); the recursions over the tool-output hole
are compared where they agree and have their own test in
tests/conformance/divergences/test_advantages.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxcorr.losses import advantages_scan as scan_lib
from jaxcorr.losses import kl as kl_lib
from jaxcorr.losses import masked
from jaxcorr.losses import rewards as rw
from tests.helpers import advantage_replay as ar
from tests.helpers import golden_data as gd
from tests.helpers.tolerance import assert_close

SLIME_SKIP = {
  'adv/grpo_opd': (
    "slime's on-policy distillation term (use_opd, teacher log-probs) is "
    'losses.distill.reverse_kl_advantage, replayed in '
    'tests/conformance/distill/test_distill.py'
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


@pytest.mark.parametrize('case', gd.case_params('slime', group='adv'))
def test_slime_advantage(case):
  if case['id'] in SLIME_SKIP:
    pytest.skip(SLIME_SKIP[case['id']])
  gs = gd.load('slime')
  kw, out = gs.kwargs(case), gs.outputs(case)
  lengths, resp, loss, rewards, ids = ar.slime_rows(gs)
  # The sequence rewards slime's estimator received, post-processed by
  # `_post_process_rewards` (group-normalised for the GRPO family).
  seq = _slime_sequence_values(
    kw['advantage_estimator'], True, True, rewards, resp, ids
  )
  assert_close(seq, out['rewards_in'], what='rewards_in')
  t = resp.shape[1]
  a, r, kl = ar.slime_pipeline(kw, resp, loss, rewards, ids, t)
  exp_a, exp_r = (
    ar.pad_rows(out['advantages'], t),
    ar.pad_rows(out['returns'], t),
  )
  if kw['kl_coef'] > 0 or kw['use_rollout_logprobs']:
    assert_close(kl, ar.pad_rows(out['kl_stored'], t), mask=loss, what='kl')
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
      assert_close(r, exp_r, mask=cmp, what='returns')
      slime_g = exp_r
      if kw['advantage_estimator'] == 'ppo':
        slime_g = exp_r - ar.unpack(kw['values'], lengths, t)
      assert_close(
        scan_lib.whiten(slime_g, loss), exp_a, mask=loss, what='whiten'
      )
      return
  assert_close(a, exp_a, mask=cmp, what='advantages')
  assert_close(r, exp_r, mask=cmp, what='returns')


def _slime_sequence_values(est, norm, std, rewards, resp, ids):
  """The per-sample reward slime's estimator sees, computed by jaxcorr."""
  scores = rw.place_at_last_token(rewards, resp)
  last = np.asarray(rw.last_token_index(resp))
  rows = np.arange(len(rewards))
  if not norm or est in ('reinforce_plus_plus', 'ppo'):
    # No group normalisation: placement keeps the reward as the score s_i.
    return np.asarray(masked.row_sum(scores, resp))
  by_std = std and est != 'reinforce_plus_plus_baseline'
  a, _ = ar.run_estimator('grpo', scores, resp, ids, norm_adv_by_std=by_std)
  return a[rows, last]


@pytest.mark.parametrize('case', gd.case_params('slime', group='rewards'))
def test_slime_reward_post_processing(case):
  gs = gd.load('slime')
  kw, out = gs.kwargs(case), gs.outputs(case)
  _, resp, _, _, ids = ar.slime_rows(gs)
  rewards = np.asarray(kw['raw_rewards'], np.float32)
  got = _slime_sequence_values(
    kw['advantage_estimator'],
    kw['rewards_normalization'],
    kw['grpo_std_normalization'],
    rewards,
    resp,
    ids,
  )
  assert_close(got, out['rewards'])


@pytest.mark.parametrize('case', gd.case_params('slime', group='gae'))
def test_slime_gae(case):
  gs = gd.load('slime')
  kw, out = gs.kwargs(case), gs.outputs(case)
  lengths, resp, *_ = ar.slime_rows(gs)
  t = resp.shape[1]
  values = ar.unpack(kw['values'], lengths, t)
  rewards = ar.unpack(kw['rewards'], lengths, t)
  _, r = ar.run_estimator(
    'gae',
    rewards,
    resp,
    values=values,
    gamma=kw['gamma'],
    lam=kw['lambd'],
  )
  assert_close(r, ar.pad_rows(out['returns'], t), mask=resp, what='returns')
  g = np.where(resp, r - values, 0)
  assert_close(
    g, ar.pad_rows(out['advantages'], t), mask=resp, what='advantages'
  )


@pytest.mark.parametrize('case', gd.case_params('slime', group='util'))
def test_slime_util(case):
  gs = gd.load('slime')
  kw, out = gs.kwargs(case), gs.outputs(case)
  if case['id'].startswith('util/chunked_discounted_returns'):
    _, resp, *_ = ar.slime_rows(gs)
    _, r = ar.run_estimator(
      'reinforce_plus_plus', kw['rewards'], resp, gamma=kw['discount']
    )
    assert_close(r, out['returns'], mask=resp)
    return
  m = kw['mask'][None] > 0
  assert_close(scan_lib.whiten(kw['values'][None], m), out['out'][None], mask=m)


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
  lengths, resp, _, rewards, _ = ar.slime_rows(gs)
  t = resp.shape[1]
  old = ar.unpack(kw['log_probs'], lengths, t)
  ref = ar.unpack(kw['ref_log_probs'], lengths, t)
  values = ar.unpack(kw['values'], lengths, t)
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
  before = ar.pad_rows(out['kl_stored_before_fix'], t)
  assert not np.allclose(np.asarray(kl)[resp], before[resp], atol=1e-3)
  if beta > 0:
    assert_close(kl, ar.pad_rows(out['raw_kl'], t), mask=resp, what='raw_kl')
    assert_close(
      kl,
      ar.pad_rows(out['kl_stored_after_fix'], t),
      mask=resp,
      what='after fix',
    )
  else:
    # slime skips the KL when β = 0 (raw_kl = 0): its pre-fix log was the
    # placed reward itself. jaxcorr's token rewards are the scores.
    assert_close(before, scores_before, mask=resp, what='pre-fix log = reward')
    np.testing.assert_array_equal(np.asarray(shaped), scores_before)
  _, r = ar.run_estimator(
    'gae', shaped, resp, values=values, gamma=kw['gamma'], lam=kw['lambd']
  )
  assert_close(
    r, ar.pad_rows(out['returns_after_fix'], t), mask=resp, what='returns'
  )
  g = np.where(resp, r - values, 0)
  assert_close(
    g, ar.pad_rows(out['advantages_after_fix'], t), mask=resp, what='advantages'
  )
