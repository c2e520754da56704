"""dense_einsum: the same values and gradients as jnp.einsum, saved by the
`dots` remat policy, bad equations refused."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcorr.model.projection import dense_einsum
from tests.helpers.model_testing import random_model, tiny_config

# (equation, x shape, w shape): the model's projections, both branches of
# the narrow-operand choice (in <= out and in > out).
CASES = [
  ('bsd,df->bsf', (3, 5, 8), (8, 12)),  # gate / up: in < out
  ('bsf,fd->bsd', (3, 5, 12), (12, 8)),  # down: in > out
  ('bsd,dhk->bshk', (2, 7, 8), (8, 4, 3)),  # q / k / v
  ('bshk,hkd->bsd', (2, 7, 4, 3), (4, 3, 8)),  # o
  ('bsd,do->bso', (2, 3, 8), (8, 1)),  # the MoE shared-expert gate
]


def _inputs(xs, ws, dtype=jnp.float32):
  kx, kw, kc = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, xs, dtype)
  w = jax.random.normal(kw, ws, dtype)
  return x, w, kc


@pytest.mark.parametrize('eq,xs,ws', CASES)
def test_values_and_gradients_match_einsum(eq, xs, ws):
  x, w, kc = _inputs(xs, ws)
  out = jnp.einsum(eq, x, w)
  cot = jax.random.normal(kc, out.shape)

  def vjp(f, x, w, cot):
    y, pull = jax.vjp(f, x, w)
    return (y, *pull(cot))

  def dense(a, b):
    return dense_einsum(eq, a, b)

  want = vjp(lambda a, b: jnp.einsum(eq, a, b), x, w, cot)
  for got in (
    vjp(dense, x, w, cot),
    jax.jit(vjp, static_argnums=0)(dense, x, w, cot),
  ):
    for g, r in zip(got, want, strict=True):
      assert g.shape == r.shape and g.dtype == r.dtype
      np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)


def test_bfloat16_gradients_keep_the_dtype():
  eq, xs, ws = CASES[0]
  x, w, _ = _inputs(xs, ws, jnp.bfloat16)
  _, pull = jax.vjp(lambda a, b: dense_einsum(eq, a, b), x, w)
  dx, dw = pull(jnp.ones((3, 5, 12), jnp.bfloat16))
  assert dx.dtype == dw.dtype == jnp.bfloat16
  ref = jnp.einsum('bsd,bsf->df', x.astype(jnp.float32), jnp.ones((3, 5, 12)))
  np.testing.assert_allclose(dw.astype(jnp.float32), ref, rtol=2e-2)


@pytest.mark.parametrize('eq', ['bsd,bdf->bsf', 'bsd,dd->bsd'])
def test_batch_letters_in_the_kernel_are_refused(eq):
  x = jnp.ones((2, 3, 4))
  w = jnp.ones((2, 4, 4)) if eq.startswith('bsd,b') else jnp.ones((4, 4))
  with pytest.raises(ValueError, match='dense_einsum equation'):
    dense_einsum(eq, x, w)


def _dots_in_gradient(remat: str) -> int:
  model = random_model(tiny_config(remat=remat))
  graphdef, params = nnx.split(model)
  tokens = jnp.zeros((2, 8), jnp.int32)

  def f(p):
    hidden, _ = nnx.merge(graphdef, p).hidden_states(tokens)
    return jnp.sum(hidden**2)

  hlo = jax.jit(jax.grad(f)).lower(params).compile().as_text()
  return len(re.findall(r' dot\(', hlo))


def test_dots_remat_policy_saves_the_projections():
  # A custom_vjp call is not a dot to the policy: without the name, 'dots'
  # would recompute every projection, as 'full' does.
  none, dots, full = (_dots_in_gradient(r) for r in ('none', 'dots', 'full'))
  assert none <= dots < full
