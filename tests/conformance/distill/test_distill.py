"""Distillation losses against TRL's and verl's reference functions, and
slime's on-policy distillation advantage (`adv/grpo_opd`).

tests/golden/distill/ holds TRL `GKDTrainer.generalized_jsd_loss` and verl
`compute_distillation_loss_{topk,reverse_kl_estimator}` called on one
shared batch (B=3, T=6, V=11, rows of length 6, 4 and 1, finite junk in
the padding): the loss and its gradient with respect to the student's
logits. See the folder's index.json for the revisions.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.losses import distill
from tests.helpers import advantage_replay as ar
from tests.helpers import golden_data as gd
from tests.helpers.tolerance import TOL_GOLDEN_FROM_LOGITS, assert_close

FOLDER = pathlib.Path(__file__).resolve().parents[2] / 'golden' / 'distill'
INDEX = json.loads((FOLDER / 'index.json').read_text())
DATA = dict(np.load(FOLDER / 'golden.npz'))
CASES = [
  pytest.param(c['id'], marks=pytest.mark.golden('distill'))
  for c in INDEX['cases']
]


def _inputs():
  return (
    jnp.asarray(DATA['inputs/student_logits']),
    jnp.asarray(DATA['inputs/teacher_logits']),
    jnp.asarray(DATA['inputs/mask']),
  )


def _loss_fn(case):
  kw = next(c for c in INDEX['cases'] if c['id'] == case)['kwargs']
  _, t_logits, mask = _inputs()
  t_full = jax.nn.log_softmax(t_logits, -1)
  if case.startswith('trl_gjsd/'):
    return lambda s: distill.generalized_jsd(
      s, t_logits, mask, beta=kw['beta'], temperature=kw['temperature']
    )
  if case.startswith('verl_topk/'):
    idx = jnp.asarray(DATA['inputs/topk_indices'])

    def topk(s):
      s_top = distill.topk_logp(jax.nn.log_softmax(s, -1), idx)
      return distill.topk_kl(
        s_top, distill.topk_logp(t_full, idx), mask, kw['loss_clamp'],
        direction=kw['loss_mode'].split('_')[0],
      )  # fmt: skip

    return topk
  ids = jnp.asarray(DATA['inputs/sampled_ids'])[..., None]

  def estimator(s):
    s_lp = jnp.take_along_axis(jax.nn.log_softmax(s, -1), ids, -1)[..., 0]
    t_lp = jnp.take_along_axis(t_full, ids, -1)[..., 0]
    return distill.reverse_kl_loss(s_lp, t_lp, mask, estimator=kw['loss_mode'])

  return estimator


@pytest.mark.parametrize('case', CASES)
def test_distill_golden(case):
  s_logits, _, _ = _inputs()
  (loss, metrics), grad = jax.value_and_grad(_loss_fn(case), has_aux=True)(
    s_logits
  )
  tol = TOL_GOLDEN_FROM_LOGITS
  assert_close(loss, DATA[f'{case}/loss'], tol, what=f'{case} loss')
  assert_close(
    grad, DATA[f'{case}/grad_student_logits'], tol, what=f'{case} grad'
  )
  for name in ('student_mass', 'teacher_mass'):
    if f'{case}/{name}' in DATA:
      assert_close(
        metrics[f'distill/{name}'], DATA[f'{case}/{name}'], tol, what=name
      )


@pytest.mark.golden('slime')
def test_slime_opd_advantage():
  """slime `--use-opd --opd-type sglang`: the GRPO advantage minus
  `opd_kl_coef·(log_probs − teacher_log_probs)` on every response token,
  with the teacher = ref − 0.05 (the case's note)."""
  gs = gd.load('slime')
  case = gs.case('adv/grpo_opd')
  kw, out = gs.kwargs(case), gs.outputs(case)
  lengths, resp, _, _, _ = ar.slime_rows(gs)
  t = resp.shape[1]
  old = ar.unpack(kw['log_probs'], lengths, t)
  teacher = ar.unpack(kw['ref_log_probs'], lengths, t) - np.float32(0.05)
  task = np.where(resp, np.asarray(out['rewards_in'])[:, None], 0)
  adv, metrics = distill.reverse_kl_advantage(
    jnp.asarray(old),
    jnp.asarray(teacher),
    jnp.asarray(resp),
    jnp.asarray(task, jnp.float32),
    kw['opd_kl_coef'],
    estimator='k1',
  )
  kl = ar.pad_rows(out['opd_reverse_kl'], t)
  assert_close(np.where(resp, old - teacher, 0), kl, what='opd_reverse_kl')
  assert_close(adv, ar.pad_rows(out['advantages'], t), what='advantages')
  assert_close(
    metrics['distill/reverse_kl'], kl[resp].mean(), what='reverse_kl'
  )


@pytest.mark.golden('prime')
def test_prime_legacy_teacher_kl_metric():
  """prime-rl (bf71516c9) `teacher_tau`: its advantage term is
  `τ·(teacher − trainer)` per token and `teacher_kl` its per-sample masked
  mean, i.e. minus jaxcorr's k1 reverse KL of that row. The loss itself
  also carries legacy `kl_tau`, which is not expressible (prime tests)."""
  gs = gd.load('prime')
  case = gs.case('legacy/default_loss_fn/teacher_tau0.5')
  kw, out = gs.kwargs(case), gs.outputs(case)
  lengths = gs.dataset()['lengths']
  t = int(lengths.max())

  def rows(flat):
    return jnp.asarray(ar.unpack(np.asarray(flat), lengths, t))

  cur, teacher = rows(kw['trainer_logprobs']), rows(kw['ref_logprobs'])
  mask = rows(kw['loss_mask']) > 0

  def one(s, te, m):
    return distill.reverse_kl_advantage(s[None], te[None], m[None])[1]

  metrics = jax.vmap(one)(cur, teacher, mask)
  assert_close(
    -metrics['distill/reverse_kl'], out['metric/teacher_kl'], what='kl'
  )
