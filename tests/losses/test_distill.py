"""Reduces-to, padding and gradient contracts of losses/distill.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.losses import correction as corr_lib
from jaxcorr.losses import distill
from tests.helpers.tolerance import TOL_GOLDEN, assert_close

B, T, V = 3, 5, 7
MASK = jnp.asarray(np.arange(T)[None] < np.array([5, 3, 1])[:, None])


def _logits(seed, t=T):
  return jax.random.normal(jax.random.key(seed), (B, t, V)) * 2


def _sampled(logits):
  ids = jnp.argmax(logits, -1)[..., None]
  return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), ids, -1)[..., 0]


def _per_token_losses():
  """(name, f(student, teacher) -> scalar) over `[B, T, V]` logits."""

  def adv(s, t):  # the policy-gradient surrogate of the dense advantage
    a, _ = distill.reverse_kl_advantage(_sampled(s), _sampled(t), MASK)
    return jnp.sum(jax.lax.stop_gradient(a) * _sampled(s))

  def direct(est):
    return lambda s, t: distill.reverse_kl_loss(
      _sampled(s), _sampled(t), MASK, estimator=est
    )[0]

  def jsd(beta):
    return lambda s, t: distill.generalized_jsd(s, t, MASK, beta=beta)[0]

  def topk_full(direction):  # top-k over the whole vocabulary: mass 1
    idx = jnp.broadcast_to(jnp.arange(V), (B, T, V))

    def f(s, t):
      lp = [distill.topk_logp(jax.nn.log_softmax(x, -1), idx) for x in (s, t)]
      return distill.topk_kl(*lp, MASK, direction=direction)[0]

    return f

  return [
    ('advantage_k1', adv),
    ('loss_k3', direct('k3')),
    ('jsd_0', jsd(0.0)),
    ('jsd_0.5', jsd(0.5)),
    ('jsd_1', jsd(1.0)),
    ('topk_forward', topk_full('forward')),
    ('topk_reverse', topk_full('reverse')),
  ]


@pytest.mark.parametrize('name,fn', _per_token_losses())
def test_teacher_equals_student_zero_kl_and_gradient(name, fn):
  s = _logits(0)
  value, grad = jax.value_and_grad(fn)(s, s)
  assert abs(float(value)) < 1e-6, name
  assert_close(grad, jnp.zeros_like(grad), TOL_GOLDEN, what=name)


@pytest.mark.parametrize('name,fn', _per_token_losses())
def test_no_gradient_into_the_teacher(name, fn):
  g = jax.grad(fn, argnums=1)(_logits(0), _logits(1))
  assert not np.any(np.asarray(g)), name


@pytest.mark.parametrize('name,fn', _per_token_losses())
def test_padding_invariance(name, fn):
  """Junk logits outside the mask change neither the value nor the
  gradient, and no gradient reaches a padding position."""
  s, t = _logits(0), _logits(1)
  pad = jnp.broadcast_to(~MASK[..., None], s.shape)
  v0, g0 = jax.value_and_grad(fn)(s, t)
  v1, g1 = jax.value_and_grad(fn)(
    jnp.where(pad, 1e4, s), jnp.where(pad, -1e4, t)
  )
  assert_close(v1, v0, what=f'{name} value')
  assert_close(g1, jnp.where(pad, 0, g0), what=name)
  assert not np.any(np.asarray(g0)[np.asarray(pad)])


def test_nan_padding_at_log_prob_inputs():
  """The log-prob entry points zero padding at their inputs: NaN there is
  harmless to the value and to the gradient."""
  s, t = _sampled(_logits(0)), _sampled(_logits(1))
  nan_s, nan_t = jnp.where(MASK, s, jnp.nan), jnp.where(MASK, t, jnp.nan)
  for est in distill.ESTIMATORS:

    def f(a, b, e=est):
      return distill.reverse_kl_loss(a, b, MASK, estimator=e)[0]

    v0, g0 = jax.value_and_grad(f)(s, t)
    v1, g1 = jax.value_and_grad(f)(nan_s, nan_t)
    assert_close(v1, v0, what=est)
    assert_close(g1, g0, what=est)
    adv, _ = distill.reverse_kl_advantage(nan_s, nan_t, MASK, estimator=est)
    assert np.all(np.isfinite(adv)) and not np.any(np.asarray(adv)[~MASK])


def test_beta_end_points_are_trl_forward_and_reverse_kl():
  """TRL: β = 0 is KL(teacher ‖ student) (forward), β = 1 KL(student ‖
  teacher); with λ = 1 (every batch the student's own samples) GKD is
  on-policy forward KL."""
  s, t = _logits(0), _logits(1)
  ls, lt = jax.nn.log_softmax(s, -1), jax.nn.log_softmax(t, -1)
  fwd = jnp.sum(jnp.exp(lt) * (lt - ls), -1)
  rev = jnp.sum(jnp.exp(ls) * (ls - lt), -1)
  n = jnp.sum(MASK)
  for beta, want in ((0.0, fwd), (1.0, rev)):
    got, _ = distill.generalized_jsd(s, t, MASK, beta=beta)
    assert_close(got, jnp.sum(jnp.where(MASK, want, 0)) / n, what=str(beta))
  keys = jax.random.split(jax.random.key(0), 64)
  assert np.all(jax.vmap(distill.gkd_on_policy, (0, None))(keys, 1.0))
  assert not np.any(jax.vmap(distill.gkd_on_policy, (0, None))(keys, 0.0))


def test_advantage_keeps_task_advantage_and_weights_kl():
  s, t = _sampled(_logits(0)), _sampled(_logits(1))
  task = jnp.ones((B, T))
  adv, _ = distill.reverse_kl_advantage(s, t, MASK, task, 0.25)
  want = jnp.where(MASK, 1 - 0.25 * (s - t), 0)
  assert_close(adv, want, what='A - c (s - t)')
  k3, _ = distill.reverse_kl_advantage(s, t, MASK, estimator='k3')
  d = t - s
  assert_close(k3, jnp.where(MASK, -(jnp.exp(d) - d - 1), 0), what='k3')


def test_estimator_and_beta_errors_name_the_field():
  s = _sampled(_logits(0))
  with pytest.raises(ValueError, match=r'distill\.estimator'):
    distill.reverse_kl_loss(s, s, MASK, estimator='k2')
  with pytest.raises(ValueError, match=r'distill\.beta'):
    distill.generalized_jsd(_logits(0), _logits(0), MASK, beta=1.5)


def test_teacher_gap_metrics_are_the_rollout_corr_statistics():
  trainer, engine = _sampled(_logits(0)), _sampled(_logits(0)) - 0.03
  got = distill.teacher_gap_metrics(trainer, engine, MASK)
  corr = corr_lib.rollout_correction(
    trainer, engine, MASK, corr_lib.CorrectionConfig()
  )
  assert got
  for key, value in got.items():
    assert key.startswith('teacher_corr/')
    want = corr.metrics['rollout_corr/' + key.removeprefix('teacher_corr/')]
    assert_close(value, want, what=key)
  assert_close(got['teacher_corr/kl'], -0.03, what='kl')


def test_select_teacher_per_row():
  stacked = jnp.stack([jnp.full((B, T), float(k)) for k in range(3)])
  out = distill.select_teacher(stacked, jnp.array([2, 0, 1]))
  assert_close(out[:, 0], jnp.array([2.0, 0.0, 1.0]), what='rows')
