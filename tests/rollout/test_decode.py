"""The device-resident decode path of `driver.generate`: chunked decoding,
attention buckets, batch shrinking and shared prompt prefills change
nothing in the batch (tokens equal, log-probs within float32 noise)."""

import jax
import numpy as np
import pytest

from jaxcorr.rollout import driver
from jaxcorr.rollout.engine import PolicyEngine, SamplingParams
from tests.helpers.model_testing import random_model, tiny_config

PROMPTS = [[3, 4, 5], list(range(10, 31)), [7], [9] * 9, [20, 21, 22]]


@pytest.fixture(scope='module')
def model():
  return random_model(tiny_config())


def _engine(model, **kw):
  return PolicyEngine(model, max_prefill_length=32, max_target_length=64, **kw)


def test_chunks_buckets_and_shrinking_do_not_change_the_batch(model):
  kw = dict(
    num_samples=4,
    max_new_tokens=20,
    temperature=1.1,
    stop_token_ids=tuple(range(0, 128, 9)),
    seed=4,
  )
  # 16 slots for 20 requests: refills, then a shrink to 8 rows once the
  # queue is empty; short chunks and small attention buckets.
  wide = _engine(
    model, max_concurrent_decodes=16, decode_chunk=3, min_attend_bucket=8
  )
  sizes = []  # the slot counts `compact` shrank the batch to
  compact = wide.compact
  wide.compact = lambda state, rows: (
    sizes.append(len(rows)) or compact(state, rows)
  )
  a = driver.generate(wide, PROMPTS, **kw)
  # Counted by call, not by jit cache size: jit caches are shared by every
  # wrapper of one function and may be evicted, so their size says nothing.
  assert sizes and all(s < 16 for s in sizes), sizes  # the batch did shrink
  narrow = _engine(model, max_concurrent_decodes=2, decode_chunk=16)
  b = driver.generate(narrow, PROMPTS, **kw)
  assert (a.finish_reason == 0).any() and (a.finish_reason == 1).any()
  np.testing.assert_array_equal(a.response_tokens, b.response_tokens)
  np.testing.assert_array_equal(a.response_mask, b.response_mask)
  np.testing.assert_array_equal(a.finish_reason, b.finish_reason)
  np.testing.assert_allclose(a.rollout_logp, b.rollout_logp, atol=1e-5)


def test_samples_share_one_prefill_and_keep_their_own_keys(model):
  engine = _engine(model, max_concurrent_decodes=4)
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  sp = SamplingParams(temperature=1.5)
  # Two prompts, four requests: prompt 1 serves requests 0, 1, 3.
  prefix = engine.prefill_batch(
    engine.params, [PROMPTS[0], PROMPTS[3]], [1, 1, 0, 1], keys, sp
  )
  assert prefix.cache.k[0].shape[0] == 2  # one cache row per prompt
  for m, (prompt, key) in enumerate(zip([3, 3, 0, 3], keys)):
    padded, n = engine.pad_prompt(PROMPTS[prompt])
    one = engine.prefill(
      params=engine.params,
      padded_tokens=padded,
      true_length=n,
      sampling_params=sp,
      key=key,
    )
    assert int(one.token[0]) == int(prefix.token[m])
    np.testing.assert_allclose(one.logp[0], prefix.logp[m], atol=1e-5)


def test_warm_up_dispatches_every_variant_generate_uses(model):
  """`Decoder.warm_up` runs `decode_chunk` for every (batch size,
  attention bucket) and `compact` for every pair of sizes the decoder can
  reach, so a batch that refills and shrinks compiles nothing new."""
  from jaxcorr.rollout.decoder import Decoder

  engine = _engine(
    model, max_concurrent_decodes=16, decode_chunk=3, min_attend_bucket=8
  )
  seen = {'chunk': set(), 'compact': set()}
  chunk, compact = engine.decode_chunk, engine.compact

  def record_chunk(state, stop, **kw):
    seen['chunk'].add((state.tokens.shape[0], kw['attend_len'], stop.shape))
    return chunk(state, stop, **kw)

  def record_compact(state, rows):
    seen['compact'].add((state.tokens.shape[0], len(rows)))
    return compact(state, rows)

  engine.decode_chunk, engine.compact = record_chunk, record_compact
  stop = tuple(range(0, 128, 9))
  Decoder(
    engine,
    sp=SamplingParams(1.1, 0, 1.0, 0.0),
    max_new_tokens=20,
    stop_token_ids=stop,
  ).warm_up()
  warmed = {k: set(v) for k, v in seen.items()}
  assert {s for s, _, _ in warmed['chunk']} == {16, 8}
  assert warmed['compact'] == {(16, 8)}
  for seed in range(3):
    driver.generate(
      engine, PROMPTS, num_samples=4, max_new_tokens=20,
      temperature=1.1, stop_token_ids=stop, seed=seed,
    )  # fmt: skip
  assert seen['compact'] and seen == warmed, (seen, warmed)
