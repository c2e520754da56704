"""Adapter-only weight sync (jaxcorr/rollout/adapter_weights.py): a row
sampled across an adapter swap records per token the version that sampled
it, with the trainer's log-prob under that version's adapters; the merged
and unmerged engines decode the same function; the delivery check raises
when a sync is skipped."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcorr.model.lora import LoraConfig, apply_lora, join, split_adapter
from jaxcorr.rollout.adapter_weights import AdapterSyncError, DeliveryProbe
from jaxcorr.rollout.decoder import Decoder, Request
from jaxcorr.rollout.engine import PolicyEngine, SamplingParams
from jaxcorr.train.rollouts.weights import AdapterPublisher
from tests.helpers.model_testing import logprobs, random_model, tiny_config

PROMPTS = [[3, 4, 5], list(range(10, 31)), [7], [9] * 9]
NEW = 16
LORA = LoraConfig(rank=4, alpha=8.0, target_modules='q_proj,v_proj,up_proj')


def _adapter(like, seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda x: jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype), like
  )


@pytest.fixture(scope='module')
def policy():
  """(LoRA model, frozen base, adapters of versions 0 and 1, publisher)."""
  model = apply_lora(random_model(tiny_config()), LORA)
  adapter, frozen = split_adapter(nnx.state(model))
  v0, v1 = _adapter(adapter, 0), _adapter(adapter, 1)
  nnx.update(model, v0)
  publish = AdapterPublisher(DeliveryProbe(model.config, LORA))
  return model, frozen, (v0, v1), publish


def _engine(model, merged: bool) -> PolicyEngine:
  return PolicyEngine(
    model,
    max_concurrent_decodes=8,
    max_prefill_length=32,
    max_target_length=64,
    decode_chunk=4,
    lora=LoraConfig(**{**vars(LORA), 'engine_merged': merged}),
  )


def _trainer_logp(model, state, req):
  seq = list(req.prompt) + req.tokens
  p, n = len(req.prompt), len(req.tokens)
  padded = jnp.asarray([seq + [0] * (64 - len(seq))])
  lp = logprobs(nnx.merge(nnx.graphdef(model), state), padded, temperature=1.0)
  return np.asarray(lp)[0, p - 1 : p - 1 + n]


@pytest.mark.parametrize(
  'merged', [True, pytest.param(False, marks=pytest.mark.slow)]
)
def test_tokens_carry_the_adapter_version_that_sampled_them(policy, merged):
  model, frozen, (v0, v1), publish = policy
  dec = Decoder(
    _engine(model, merged),
    sp=SamplingParams(temperature=1.0),
    max_new_tokens=NEW,
  )
  keys = np.asarray(jax.random.split(jax.random.PRNGKey(1), len(PROMPTS)))
  for i, p in enumerate(PROMPTS):
    dec.submit(Request(i, i, 0, p, keys[i]))
  done = dec.advance()
  update = publish(frozen, v1)  # only the adapters cross, with the probe
  assert not jax.tree.leaves(split_adapter(update.adapter)[1])
  dec.swap(update, 1, recompute=True)
  assert dec.engine.weights.last_gap < 1e-4
  while dec.busy:
    done += dec.advance()
  for req in done:
    v = np.asarray(req.versions)
    assert (v[:5] == 0).all() and (v[5:] == 1).all(), v
    ref = np.where(
      v == 0,
      _trainer_logp(model, join(frozen, v0), req),
      _trainer_logp(model, join(frozen, v1), req),
    )
    np.testing.assert_allclose(np.asarray(req.logp), ref, atol=5e-5)


def test_a_skipped_sync_is_caught(policy):
  model, frozen, (v0, v1), publish = policy
  engine = _engine(model, merged=True)
  weights = engine.weights
  engine.update_params(publish(frozen, v1), version=1)  # delivered
  # Fault: the transport drops the next adapter; the engine keeps v1's.
  deliver = weights._adapter_of
  weights._adapter_of = lambda update: (weights.adapter, weights.frozen)
  with pytest.raises(AdapterSyncError, match='version 2 not delivered'):
    engine.update_params(publish(frozen, v0), version=2)
  weights._adapter_of = deliver
  engine.update_params(publish(frozen, v0), version=3)
  assert weights.last_gap < 1e-4
