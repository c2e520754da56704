"""The deliberate divergences of the advantage estimators from the references
(docs/math/advantages.md): each test asserts jaxcorr's value on the
reference's inputs (D4, D6, D12, D13, D15, the SkyRL and slime recursions
over padding and tool-output holes, and the RLOO singleton)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxcorr.losses import advantages as adv_lib
from jaxcorr.losses import advantages_scan as scan_lib
from jaxcorr.losses import rewards as rw
from tests.helpers import advantage_replay as ar
from tests.helpers import golden_data as gd
from tests.helpers.tolerance import TOL_REORDERED_METRICS, assert_close


def test_d6_reward_in_padding_is_ignored():
  """verl's GRPO-family scores sum every position; jaxcorr valid tokens only.

  A reward of 5 left on a padded position of row 1 (length 27) moves verl's
  score of row 1 and with it group g0's mean and std; jaxcorr's advantages
  stay those of the golden (clean) batch.
  """
  gs = gd.load('verl')
  d, m, ids = ar.verl_main()
  dirty = d['token_level_rewards'].copy()
  assert not m[1, 30]
  dirty[1, 30] = 5.0
  case = gs.case('adv/grpo/default/main')
  for name in ('grpo', 'rloo', 'opo', 'gpg', 'grpo_passk', 'maxrl'):
    clean, _ = ar.run_estimator(name, d['token_level_rewards'], m, ids)
    got, _ = ar.run_estimator(name, dirty, m, ids)
    np.testing.assert_array_equal(got, clean)
  got, _ = ar.run_estimator('grpo', dirty, m, ids)
  assert_close(got, gs.outputs(case)['advantages'], mask=m)
  # verl's score of row 1 would be 5: its group g0 = [1, 5, 0, 1].
  s = dirty.sum(-1)[:4].astype(np.float64)
  verl_row1 = (s[1] - s.mean()) / (s.std(ddof=1) + 1e-6)
  assert abs(verl_row1 - got[1, 0]) > 0.5


def test_d12_empty_row_is_not_a_group_member():
  """verl counts an empty row as a member with score 0; jaxcorr drops it."""
  d, m, ids = ar.verl_main()
  m = m.copy()
  m[5] = False  # row 5 (group g1) becomes empty
  r = d['token_level_rewards']
  s = (r * m).sum(-1).astype(np.float64)
  members = [4, 6, 7]
  mu, sd = s[members].mean(), s[members].std(ddof=1)
  a, _ = ar.run_estimator('grpo', r, m, ids)
  assert (a[5] == 0).all()
  for i in members:
    assert_close(a[i][m[i]], np.full(m[i].sum(), (s[i] - mu) / (sd + 1e-6)))
  # GPG's α counts non-empty rows: |V| = 7, 5 of them with s ≠ 0.
  a, _ = ar.run_estimator('gpg', r, m, ids)
  alpha = 7 / np.count_nonzero(s[m.any(-1)])
  assert_close(a[4][m[4]], np.full(m[4].sum(), alpha * (s[4] - mu)))
  assert (a[5] == 0).all()


def test_d12_whitening_fewer_than_two_tokens_only_centres():
  """verl raises on < 2 valid tokens; jaxcorr centres (0 for one token)."""
  x = np.array([[3.0, 7.0, -1.0]], np.float32)
  one = np.array([[False, True, False]])
  np.testing.assert_array_equal(np.asarray(scan_lib.whiten(x, one)), 0.0)
  none = np.zeros_like(one)
  np.testing.assert_array_equal(np.asarray(scan_lib.whiten(x, none)), 0.0)
  for name in ('reinforce_plus_plus', 'reinforce_plus_plus_baseline', 'gae'):
    a, _ = ar.run_estimator(
      name, x, one, np.zeros(1, np.int32), values=np.ones_like(x), lam=0.95
    )
    np.testing.assert_array_equal(a, 0.0)


def test_d12_grpo_passk_singleton_gets_zero():
  """verl raises on a group with one sample; jaxcorr gives it 0."""
  r = np.zeros((3, 4), np.float32)
  r[:, -1] = [1.0, 0.25, 0.75]
  m = np.ones((3, 4), bool)
  a, _ = ar.run_estimator('grpo_passk', r, m, np.array([0, 1, 1], np.int32))
  assert (a[0] == 0).all()
  # Group 1: best row 2 gets (0.75 − 0.25)/(σ + ε).
  assert_close(a[2], np.full(4, 0.5 / (np.std([0.25, 0.75], ddof=1) + 1e-6)))
  assert (a[1] == 0).all()


def test_d13_outputs_are_zero_outside_the_mask():
  """verl leaves values in the padding (e.g. gae returns = G + values)."""
  gs = gd.load('verl')
  d, m, ids = ar.verl_main()
  exp = gs.outputs(gs.case('adv/gae/g0.99_l0.95/main'))['returns']
  assert np.abs(exp[~m]).max() > 0.1  # the reference's padding values
  for name in adv_lib.ESTIMATORS:
    ar.run_estimator(  # asserts exact zeros outside the mask
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
  a, r = ar.run_estimator(
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
  assert_close(a, back['advantages'], mask=m)
  assert_close(r, back['returns'], mask=m)
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
  d, m, ids = ar.verl_main()
  r = d['token_level_rewards']
  rs_mask = m.copy()
  rs_mask[2] = False
  ours, _ = ar.run_estimator('grpo', r, m, ids)
  assert_close(
    ours, gs.outputs(gs.case('adv/grpo/default/main'))['advantages'], mask=m
  )
  theirs, _ = ar.run_estimator('grpo', r, rs_mask, ids)
  assert not np.allclose(ours[0][m[0]], theirs[0][m[0]])
  ours_w, _ = ar.run_estimator('reinforce_plus_plus_baseline', r, m, ids)
  theirs_w, _ = ar.run_estimator(
    'reinforce_plus_plus_baseline', r, rs_mask, ids
  )
  assert not np.allclose(ours_w[7][m[7]], theirs_w[7][m[7]])


def test_d4_kl_metric_averages_non_empty_rows():
  """verl averages the per-row KL over all B rows; jaxcorr over V."""
  d, m, _ = ar.verl_main()
  m = m.copy()
  m[5] = False
  old, ref = d['old_log_prob'], d['ref_log_prob']
  _, _, metrics = rw.apply_kl_penalty(
    d['token_level_rewards'], old, ref, m, 0.05
  )
  per_row = np.where(m, old - ref, 0).sum(-1) / np.maximum(m.sum(-1), 1)
  ours = per_row[m.any(-1)].mean()
  verl = per_row.mean()  # an empty row adds a 0 to verl's mean
  assert_close(metrics[rw.KL_METRIC], ours, TOL_REORDERED_METRICS)
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
  lengths, resp, loss, rewards, ids = ar.slime_rows(gs)
  t = resp.shape[1]
  _, r, _ = ar.slime_pipeline(kw, resp, loss, rewards, ids, t)
  hole = loss[3]
  assert (~hole[: lengths[3]]).sum() == 4
  n = int(hole.sum())
  one = np.arange(t)[None, :] < n
  packed = ('log_probs', 'ref_log_probs', 'values', 'rollout_log_probs')
  flat = {
    k: ar.unpack(v, lengths, t)[3][hole] if k in packed else v
    for k, v in kw.items()
  }
  _, r_cut, _ = ar.slime_pipeline(
    flat, one, one, rewards[3:4], np.zeros(1, np.int32), t
  )
  assert_close(r[3][hole], r_cut[0][:n])
  exp = ar.pad_rows(out['returns'], t)[3]
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
  lengths, resp, loss, rewards, ids = ar.slime_rows(gs)
  t = resp.shape[1]
  scores = rw.place_at_last_token(rewards, loss)
  old = ar.unpack(kw['log_probs'], lengths, t)
  ref = ar.unpack(kw['ref_log_probs'], lengths, t)
  shaped, _, _ = rw.apply_kl_penalty(scores, old, ref, loss, 0.05)
  ours, _ = ar.run_estimator('reinforce_plus_plus_baseline', shaped, loss, ids)
  # jaxcorr: constant over each row's tokens, whitened over the batch.
  for i in range(len(lengths)):
    assert np.ptp(ours[i][loss[i]]) < 1e-6
  exp = ar.pad_rows(out['advantages'], t)
  assert np.abs(ours - exp)[loss].max() > 1e-2


def test_rloo_singleton_keeps_its_score():
  """verl `rloo` keeps s_i for a singleton; SkyRL and rloo_vectorized give 0.

  The SkyRL singleton golden agrees only because that row's reward is 0.
  """
  r = np.zeros((3, 2), np.float32)
  r[:, -1] = [0.5, 1.0, 0.0]
  m = np.ones((3, 2), bool)
  a, _ = ar.run_estimator('rloo', r, m, np.array([0, 1, 1], np.int32))
  assert_close(a[0], [0.5, 0.5])
  a, _ = ar.run_estimator('maxrl', r, m, np.array([0, 1, 1], np.int32))
  assert_close(a[0], [0.5, 0.5])
