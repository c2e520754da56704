"""Log-prob hygiene (MaxText #5231) in a bf16 model: the head's logits are
float32 (fp32 accumulation of the compute-dtype operands, no bf16 rounding)
and no log-prob the engine or the trainer reports is > 0, on a vocabulary
sharp enough that rounding puts some above 0 without the clamp."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcorr.model import logprobs_from_hidden
from jaxcorr.rollout.decode import sample_rows
from jaxcorr.sampling import nonpositive
from tests.helpers.model_testing import random_model, random_tokens, tiny_config

# A head this many times the random one makes the argmax certain at most
# positions (logits ~ 100): log q[argmax] is 0 up to rounding, the edge
# where `picked - lse` (trainer, τ ≠ 1) and log(exp(x)) (engine, greedy /
# top-p kept mass) land a few ulps above 0.
SHARPEN = 40.0


def _sharp_bf16_model():
  cfg = tiny_config(dtype='bfloat16', param_dtype='bfloat16')
  model = random_model(cfg)
  model.lm_head.set_value(model.lm_head.get_value() * SHARPEN)
  return model


@nnx.jit
def _hidden_and_logits(model, tokens):
  hidden, _ = model.hidden_states(tokens)
  return hidden, model.logits(hidden)


def test_bf16_head_logits_are_float32_not_bf16_rounded():
  model = _sharp_bf16_model()
  hidden, logits = _hidden_and_logits(model, random_tokens(2, 16))
  assert hidden.dtype == jnp.bfloat16 and logits.dtype == jnp.float32
  head = np.asarray(model.head_weight(), np.float64)
  ref = np.asarray(hidden, np.float64) @ head.T
  scale = np.abs(ref).max()
  np.testing.assert_allclose(np.asarray(logits), ref, atol=2e-7 * scale)
  rounded = np.asarray(logits.astype(jnp.bfloat16).astype(jnp.float32))
  assert not np.array_equal(np.asarray(logits), rounded)


@pytest.fixture(scope='module')
def sharp():
  model = _sharp_bf16_model()
  hidden, logits = _hidden_and_logits(model, random_tokens(8, 64, seed=1))
  return model.head_weight(), hidden, logits


def test_trainer_logprob_is_never_positive_in_bf16(sharp):
  head, hidden, logits = sharp
  targets = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  score = jax.jit(
    lambda h, w, y: logprobs_from_hidden(
      h, w, y, temperature=0.7, return_entropy=True, dtype=jnp.bfloat16
    )
  )
  trainer, _ = score(hidden, head, targets)
  # The construction reaches the edge: most argmax tokens are near-certain.
  assert float(jnp.mean(trainer > -1e-6)) > 0.5
  assert float(trainer.max()) <= 0.0


def test_engine_logprobs_are_never_positive_in_bf16(sharp):
  _, _, logits = sharp
  flat = logits.reshape(-1, logits.shape[-1])
  n = flat.shape[0]
  keys = jax.random.split(jax.random.PRNGKey(0), n)
  # Greedy, top-p and untruncated rows in one decode batch.
  sp = np.tile([[1.0, 0.0, 1.0, 0.0]], (n, 1))
  sp[0::3, 1] = 1
  sp[1::3, 2] = 0.9
  _, lp, lpt, _ = jax.jit(sample_rows)(keys, flat, jnp.asarray(sp))
  assert float(lp.max()) <= 0.0 and float(lpt.max()) <= 0.0


def test_clamp_gradient_is_zero_only_above_zero():
  x = jnp.asarray([-2.0, -1e-7, 0.0, 1e-7, 3.0])
  grad = jax.grad(lambda x: jnp.sum(nonpositive(x)))(x)
  np.testing.assert_array_equal(grad, [1.0, 1.0, 1.0, 0.0, 0.0])
  np.testing.assert_array_equal(nonpositive(x), np.minimum(np.asarray(x), 0))
  special = nonpositive(jnp.asarray([-jnp.inf, jnp.nan]))
  assert special[0] == -jnp.inf and bool(jnp.isnan(special[1]))
