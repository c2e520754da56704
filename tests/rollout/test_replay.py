"""Sampling-mask replay through the real engine (`logprob_mode='replay'`):
the engine records each token's kept set (rollout/kept_set.py), the trainer
renormalises over it (`replay_logprobs`), and with identical weights the
ratio is exactly 1 under top-p, where the 'full' ratio carries the kept-mass
bias log Z_t < 0."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr import sampling
from jaxcorr.model.logprobs import replay_logprobs
from jaxcorr.rollout import ValidationConfig, driver, validate_rollout_batch
from jaxcorr.rollout.engine import PolicyEngine
from jaxcorr.rollout.kept_set import KeptSet
from tests.helpers.model_testing import forward, random_model, tiny_config
from tests.helpers.rollout_testing import kept_mask

PROMPTS = [[3, 4, 5], list(range(10, 31)), [7], [9] * 9]


@pytest.fixture(scope='module')
def model():
  return random_model(tiny_config())


def _engine(model, capacity):
  return PolicyEngine(
    model,
    max_concurrent_decodes=3,
    max_prefill_length=32,
    max_target_length=64,
    kept_set_capacity=capacity,
  )


def _generate(engine, **kw):
  return driver.generate(
    engine, PROMPTS, num_samples=2, max_new_tokens=8, seed=3, **kw
  )


def test_replay_ratio_is_one_where_the_full_ratio_is_biased(model):
  v = model.config.vocab_size
  engine = _engine(model, v)  # C = V: no set is ever capped
  batch = _generate(engine, temperature=1.0, top_p=0.8)
  validate_rollout_batch(
    batch,
    ValidationConfig(
      vocab_size=v, top_p=0.8, samples_per_prompt=2, logprob_mode='replay'
    ),
  )
  assert batch.kept_ids.shape == (*batch.response_tokens.shape, v)
  assert not batch.kept_capped.any()
  err, bias = 0.0, []
  for i in range(batch.batch_size):
    q = PROMPTS[batch.group_id[i]]
    n = int(batch.response_mask[i].sum())
    seq = jnp.asarray([q + batch.response_tokens[i, :n].tolist()])
    # Right-padded to one length (causal) so the forward compiles once.
    padded = jnp.pad(seq, ((0, 0), (0, 64 - seq.shape[1])))
    logits = forward(model, padded)[0, len(q) - 1 : len(q) - 1 + n]
    # The recorded set is exactly the sampler's support on these logits.
    kept = KeptSet(
      ids=jnp.asarray(batch.kept_ids[i, :n]),
      count=jnp.asarray(batch.kept_count[i, :n]),
      capped=jnp.asarray(batch.kept_capped[i, :n]),
    )
    support = sampling.support(logits, 1.0, 0, 0.8)
    np.testing.assert_array_equal(kept_mask(kept, v), support)
    logp, log_mass = replay_logprobs(
      logits, seq[0, len(q) :], kept.ids, kept.count
    )
    # Engine side: its log-prob under the distribution it sampled from.
    err = max(err, np.abs(logp - batch.rollout_logp_truncated[i, :n]).max())
    bias.append(np.asarray(batch.rollout_logp[i, :n] - logp))
    np.testing.assert_allclose(logp + log_mass, batch.rollout_logp[i, :n],
                               atol=1e-5)  # fmt: skip
  assert err <= 1e-5, err  # replay ratio exp(0) = 1
  bias = np.concatenate(bias)  # full ratio: log Z_t <= 0, clearly < 0
  assert (bias <= 1e-6).all() and bias.mean() < -0.05, bias.mean()


def test_small_capacity_caps_and_validation_refuses(model):
  v = model.config.vocab_size
  batch = _generate(_engine(model, 2), top_p=1.0)
  on = batch.response_mask
  assert batch.kept_capped[on].all()
  assert (batch.kept_count[on] == 2).all()
  assert (batch.kept_ids[on][:, :2] >= 0).all()
  # Capped: the engine renormalises over the stored set too (ratio 1 to
  # the trainer), no longer the truncated value over the whole K.
  q, n = PROMPTS[batch.group_id[0]], int(on[0].sum())
  seq = jnp.asarray([q + batch.response_tokens[0, :n].tolist()])
  logits = forward(model, seq)[0, len(q) - 1 : -1]
  logp, _ = replay_logprobs(
    logits, seq[0, len(q) :], batch.kept_ids[0, :n], batch.kept_count[0, :n]
  )
  np.testing.assert_allclose(
    logp, batch.rollout_logp_truncated[0, :n], atol=1e-5
  )
  assert (batch.rollout_logp_truncated[on] > batch.rollout_logp[on]).all()
  with pytest.raises(ValueError, match='kept_capped'):
    validate_rollout_batch(
      batch,
      ValidationConfig(
        vocab_size=v, samples_per_prompt=2, logprob_mode='replay'
      ),
    )


def test_off_by_default_records_nothing(model):
  batch = _generate(_engine(model, 0), top_p=0.8)
  assert batch.kept_ids is None and batch.kept_count is None
  assert batch.kept_capped is None


def test_bad_capacity_is_rejected(model):
  with pytest.raises(ValueError, match='kept_set_capacity'):
    _engine(model, model.config.vocab_size + 1)
