"""The engine records an MoE policy's routing (`RolloutBatch.routed_experts`,
docs/moe.md): for every fed position, the experts each MoE layer chose,
from prefill and every decode step, under the weights that sampled the
token (across an in-flight swap too); dense policies record nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcorr.model import Transformer
from jaxcorr.model.moe import routing_shape
from jaxcorr.rollout import ValidationConfig, driver, validate_rollout_batch
from jaxcorr.rollout.decoder import Decoder, Request
from jaxcorr.rollout.engine import PolicyEngine, SamplingParams
from tests.helpers.model_testing import random_model, tiny_config
from tests.model.test_moe import moe_config

PROMPTS = [[3, 4, 5], list(range(10, 21)), [7]]
NEW = 6


@nnx.jit
def own_routing(model, tokens):
  return model.routed_hidden_states(tokens)[2].experts


def engine_for(model, chunk=4):
  return PolicyEngine(
    model,
    max_concurrent_decodes=4,
    max_prefill_length=16,
    max_target_length=32,
    decode_chunk=chunk,
  )


def check_against_trainer(model, batch, rows_versions=None):
  """Every recorded set == the trainer's own full-sequence routing (fp32),
  -1 exactly where nothing was fed."""
  p = batch.prompt_tokens.shape[1]
  for row in range(batch.batch_size):
    q = int(batch.prompt_mask[row].sum())
    n = int(batch.context_mask[row].sum())
    seq = list(batch.prompt_tokens[row, p - q :]) + list(
      batch.response_tokens[row, :n]
    )
    ref = np.asarray(
      own_routing(model, jnp.asarray([seq + [0] * (32 - len(seq))]))
    )
    got = batch.routed_experts[row, p - q : p + n - 1]
    np.testing.assert_array_equal(
      np.sort(got, -1), np.sort(ref[0, : q + n - 1], -1)
    )
    assert (batch.routed_experts[row, : p - q] == -1).all()
    assert (batch.routed_experts[row, p + n - 1 :] == -1).all()


def test_sync_generate_records_prefill_and_decode_routing():
  model = Transformer(moe_config(vocab_size=32), rngs=nnx.Rngs(0))
  batch = driver.generate(
    engine_for(model), PROMPTS, max_new_tokens=NEW, num_samples=2
  )
  layers, k, e = routing_shape(model.config)
  assert batch.routed_experts.shape == (6, 11 + NEW, layers, k)
  validate_rollout_batch(
    batch,
    ValidationConfig(
      vocab_size=32, samples_per_prompt=2, routing=(layers, k, e),
      needs_routing=True,
    ),
  )  # fmt: skip
  check_against_trainer(model, batch)
  # A corrupted record is caught with the rule named.
  bad = batch.replace(routed_experts=np.where(batch.routed_experts >= 0, e, -1))
  with pytest.raises(ValueError, match='routed_experts'):
    validate_rollout_batch(
      bad,
      ValidationConfig(
        vocab_size=32, samples_per_prompt=2, routing=(layers, k, e)
      ),
    )


def test_dense_engine_records_nothing():
  batch = driver.generate(
    engine_for(random_model(tiny_config(vocab_size=32))),
    PROMPTS,
    max_new_tokens=3,
  )
  assert batch.routed_experts is None


@pytest.mark.slow
def test_stream_swap_records_each_tokens_own_version():
  """Tokens sampled before a swap carry version 0's routing, those after
  version 1's (no recompute of the record: the version that sampled)."""
  old = Transformer(moe_config(vocab_size=32), rngs=nnx.Rngs(0))
  new = Transformer(moe_config(vocab_size=32), rngs=nnx.Rngs(1))
  engine = engine_for(old, chunk=2)
  dec = Decoder(engine, sp=SamplingParams(), max_new_tokens=NEW)
  keys = np.asarray(jax.random.split(jax.random.PRNGKey(1), len(PROMPTS)))
  for i, p in enumerate(PROMPTS):
    dec.submit(Request(i, i, 0, p, keys[i]))
  done = dec.advance()
  dec.swap(nnx.state(new), 1, recompute=True)
  while dec.busy:
    done += dec.advance()
  done.sort(key=lambda r: r.row)
  batch = driver.to_batch(engine, done, NEW, SamplingParams())
  p = batch.prompt_tokens.shape[1]
  for row, req in enumerate(done):
    seq = list(req.prompt) + req.tokens
    pad = jnp.asarray([seq + [0] * (32 - len(seq))])
    ref = {
      v: np.asarray(own_routing(m, pad))[0] for v, m in ((0, old), (1, new))
    }
    q = len(req.prompt)
    # Fed token j (prompt, then response j - q) was fed by the step that
    # sampled token j + 1: that step's version.
    versions = [0] * q + req.versions[1:]
    for j in range(q + len(req.tokens) - 1):
      v = versions[j] if j >= q else 0
      got = batch.routed_experts[row, p - q + j]
      np.testing.assert_array_equal(np.sort(got, -1), np.sort(ref[v][j], -1))
    assert set(req.versions) == {0, 1} or len(req.tokens) <= 2
