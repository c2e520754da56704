"""KL estimators (jaxcorr/losses/kl.py): the straight-through `+` variants,
unknown names, no gradient through the reference, bounded k3, the
straight-through bias (Monte Carlo), and the |·| gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.losses import kl as kl_lib


def test_plus_variants_value_and_gradient():
  rng = np.random.default_rng(3)
  lp = rng.normal(size=(4, 6)).astype(np.float32)
  ref = lp + rng.normal(scale=0.5, size=(4, 6)).astype(np.float32)
  mask = rng.random((4, 6)) > 0.2

  def total(est):
    return lambda x: jnp.sum(kl_lib.kl_penalty(x, ref, est, mask=mask))

  g_k2 = jax.grad(total('k2'))(lp)
  for base in ('k1', 'abs', 'k2', 'k3', 'kl', 'mse', 'low_var_kl'):
    v_plus = kl_lib.kl_penalty(lp, ref, base + '+', mask=mask)
    v_base = kl_lib.kl_penalty(lp, ref, base, mask=mask)
    np.testing.assert_allclose(v_plus, v_base, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(jax.grad(total(base + '+'))(lp), g_k2, 1e-6)
  # k2+ and mse+ are k2 itself, value and gradient.
  np.testing.assert_array_equal(
    kl_lib.kl_penalty(lp, ref, 'k2+', mask=mask),
    kl_lib.kl_penalty(lp, ref, 'k2', mask=mask),
  )


@pytest.mark.parametrize('name', ['full', 'k4', 'k2++', '', 'K2'])
def test_unknown_estimators(name):
  with pytest.raises(ValueError, match='not a KL estimator; allowed'):
    kl_lib.kl_penalty(jnp.zeros((1, 2)), jnp.zeros((1, 2)), name)


def test_no_gradient_through_reference():
  lp = jnp.array([[0.1, -0.3]])
  ref = jnp.array([[-0.2, 0.4]])
  for est in ('k1', 'abs', 'k2', 'k3', 'k3+'):
    g = jax.grad(lambda r, e=est: jnp.sum(kl_lib.kl_penalty(lp, r, e)))(ref)
    assert not np.any(np.asarray(g))


def test_k3_extreme_log_ratios_finite_and_bounded():
  lp = jnp.array([[-1e4, 1e4, 0.0, 30.0, -30.0]])
  ref = jnp.zeros_like(lp)
  val, grad = jax.value_and_grad(
    lambda x: jnp.sum(kl_lib.kl_penalty(x, ref, 'k3'))
  )(lp)
  assert np.isfinite(val) and np.all(np.isfinite(grad))
  assert np.all(np.abs(kl_lib.kl_penalty(lp, ref, 'k3')) <= 10)


def test_straight_through_bias_monte_carlo():
  """Averaged pathwise gradients on a 5-token softmax: k2 matches the true
  ∇KL(π_θ‖π_ref), k3 (used as a loss) does not; k3+ behaves like k2."""
  logits = jnp.array([0.3, -0.5, 1.2, 0.0, -1.0])
  ref_logits = jnp.array([-0.2, 0.4, 0.8, -0.6, 0.1])
  ref_lp = jax.nn.log_softmax(ref_logits)

  def true_kl(z):
    lp = jax.nn.log_softmax(z)
    return jnp.sum(jnp.exp(lp) * (lp - ref_lp))

  exact = jax.grad(true_kl)(logits)
  samples = jax.random.categorical(jax.random.key(0), logits, shape=(200_000,))

  def mc_grad(est):
    def loss(z):
      lp = jax.nn.log_softmax(z)[samples]
      return jnp.mean(kl_lib.kl_penalty(lp, ref_lp[samples], est))

    return jax.grad(loss)(logits)

  err = {e: float(jnp.max(jnp.abs(mc_grad(e) - exact))) for e in ('k2', 'k3')}
  scale = float(jnp.max(jnp.abs(exact)))
  assert err['k2'] < 0.02 * scale + 2e-3, err
  assert err['k3'] > 0.1 * scale, err
  np.testing.assert_allclose(mc_grad('k3+'), mc_grad('k2'), rtol=1e-5)


def test_abs_gradient_is_zero_where_logps_agree():
  # torch's |d| differentiates to sign(d) = 0 at d = 0; so must jaxcorr's.
  lp = jnp.array([[0.5, -0.25, 0.0]])
  ref = jnp.array([[0.5, 0.25, -1.0]])
  g = jax.grad(lambda x: jnp.sum(kl_lib.kl_penalty(x, ref, 'abs')))(lp)
  np.testing.assert_array_equal(g, [[0.0, -1.0, 1.0]])
