"""`PolicyEngine` + `driver.generate` on a tiny random float32 model:
greedy == argmax of the full forward, log-probs == `token_logprobs`,
continuous batching == one request at a time, weight swaps without
recompiling, bad requests rejected while the engine keeps serving."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jetstream.engine import engine_api

from jaxcorr import sampling
from jaxcorr.rollout import ValidationConfig, driver, validate_rollout_batch
from jaxcorr.rollout.engine import PolicyEngine, SamplingParams
from tests.helpers.model_testing import (
  forward,
  logprobs,
  random_model,
  tiny_config,
)
from tests.helpers.rollout_testing import compile_count

PROMPTS = [[3, 4, 5], list(range(10, 31)), [7], [9] * 9, [20, 21, 22, 23, 24]]
STOP = (1, 2)
_PF, _TL = 32, 64


@pytest.fixture(scope='module')
def model():
  return random_model(tiny_config())


@pytest.fixture(scope='module')
def engine(model):
  return PolicyEngine(
    model,
    max_concurrent_decodes=3,
    max_prefill_length=_PF,
    max_target_length=_TL,
  )


def _sequences(batch, prompts):
  """(prompt + response) token rows of a batch, with the prompt length."""
  for i in range(batch.batch_size):
    q = list(prompts[batch.group_id[i]])
    n = int(batch.response_mask[i].sum())
    yield i, q, q + batch.response_tokens[i, :n].tolist()


def test_is_a_complete_jetstream_engine(engine):
  assert isinstance(engine, engine_api.Engine)
  assert not inspect.isabstract(PolicyEngine)
  assert engine.max_concurrent_decodes == 3
  assert engine.max_prefill_length == _PF and engine.samples_per_slot == 1
  assert engine.colocated_cpus is None
  tok = engine.build_tokenizer(engine.get_tokenizer())
  ids, n = tok.encode('5 6 7')
  assert n == 3 and tok.decode(ids.tolist()) == ' 5 6 7'  # ' <id>' per id


def test_greedy_equals_stepwise_argmax_of_the_full_forward(engine, model):
  batch = driver.generate(engine, PROMPTS, max_new_tokens=10, top_k=1)
  for i, q, _ in _sequences(batch, PROMPTS):
    seq = list(q)
    for _ in range(10):
      # Right-padded to one length (causal: padding after the last real
      # token changes nothing) so the reference compiles once.
      padded = jnp.asarray([seq + [0] * (_TL - len(seq))])
      logits = forward(model, padded)
      seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    assert batch.response_tokens[i].tolist() == seq[len(q) :], i
  assert (batch.finish_reason == 1).all()


@pytest.mark.parametrize(
  'temperature, top_k, top_p',
  [(1.0, 0, 1.0), (0.6, 5, 1.0), (1.7, 0, 0.9), (0.6, 5, 0.9)],
)
def test_logprobs_match_the_trainer(engine, model, temperature, top_k, top_p):
  """docs/math/rollout_contract.md §8 test 1 through the real engine: full
  values == token_logprobs, truncated values == the shared rule applied to the
  trainer's logits."""
  batch = driver.generate(
    engine,
    PROMPTS,
    num_samples=2,
    max_new_tokens=8,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    stop_token_ids=STOP,
    seed=3,
  )
  validate_rollout_batch(
    batch,
    ValidationConfig(
      vocab_size=model.config.vocab_size,
      temperature=temperature,
      top_k=top_k,
      top_p=top_p,
      samples_per_prompt=2,
    ),
  )
  err_full = err_trunc = 0.0
  for i, q, seq in _sequences(batch, PROMPTS):
    n, p = len(seq) - len(q), len(q)
    # Right-padded to one length (causal: padding after the last real token
    # changes nothing; the rules are row-wise) so the reference compiles
    # once for every row and parametrization, not once per length.
    tokens = jnp.asarray([seq + [0] * (_TL - len(seq))])
    rows = slice(p - 1, p - 1 + n)  # the positions predicting the response
    ref = np.asarray(logprobs(model, tokens, temperature=temperature))
    err_full = max(
      err_full, np.abs(ref[0, rows] - batch.rollout_logp[i, :n]).max()
    )
    logits = forward(model, tokens)[0, :-1]
    keep = sampling.support(logits, temperature, top_k, top_p)
    y = tokens[0, 1:]
    assert bool(keep[jnp.arange(_TL - 1), y][rows].all())  # sampled inside K
    _, trunc = sampling.token_logprobs(logits, y, temperature, keep)
    err_trunc = max(
      err_trunc,
      np.abs(trunc[rows] - batch.rollout_logp_truncated[i, :n]).max(),
    )
  assert err_full <= 1e-5 and err_trunc <= 1e-5, (err_full, err_trunc)
  assert (batch.rollout_logp_truncated >= batch.rollout_logp - 1e-6).all()
  if top_k or top_p < 1:
    assert (batch.rollout_logp_truncated > batch.rollout_logp + 1e-3).any()
  else:
    np.testing.assert_allclose(
      batch.rollout_logp_truncated, batch.rollout_logp, atol=1e-6
    )
  # Off the policy tokens: zeros and version -1.
  off = ~batch.response_mask
  assert (batch.rollout_logp[off] == 0).all()
  assert (batch.policy_version[off] == -1).all()


def test_stop_token_ends_the_response_and_belongs_to_it(engine):
  batch = driver.generate(
    engine,
    PROMPTS,
    num_samples=3,
    max_new_tokens=12,
    seed=0,
    stop_token_ids=tuple(range(0, 128, 3)),
  )
  stopped = batch.finish_reason == 0
  assert stopped.any()
  for i in np.flatnonzero(stopped):
    n = int(batch.response_mask[i].sum())
    assert batch.response_tokens[i, n - 1] % 3 == 0
    assert (batch.response_tokens[i, : n - 1] % 3 != 0).all()
    assert batch.rollout_logp[i, n - 1] < 0
  np.testing.assert_array_equal(batch.group_id, np.repeat(np.arange(5), 3))
  np.testing.assert_array_equal(batch.sample_id, np.tile(np.arange(3), 5))


def test_continuous_batching_equals_one_request_at_a_time(engine, model):
  kw = dict(
    num_samples=2,
    max_new_tokens=9,
    temperature=0.9,
    top_p=0.95,
    stop_token_ids=STOP,
    seed=11,
  )
  batched = driver.generate(engine, PROMPTS, **kw)
  single = PolicyEngine(
    model,
    max_concurrent_decodes=1,
    max_prefill_length=_PF,
    max_target_length=_TL,
  )
  serial = driver.generate(single, PROMPTS, **kw)
  np.testing.assert_array_equal(batched.response_tokens, serial.response_tokens)
  np.testing.assert_array_equal(batched.response_mask, serial.response_mask)
  np.testing.assert_allclose(
    batched.rollout_logp, serial.rollout_logp, atol=1e-5
  )
  # Samples of one prompt differ (distinct per-request keys).
  assert (batched.response_tokens[0::2] != batched.response_tokens[1::2]).any()


def test_weight_update_changes_outputs_without_compiling(engine, model):
  kw = dict(max_new_tokens=6, temperature=0.8, seed=5)
  before = driver.generate(engine, PROMPTS, **kw)
  assert (before.policy_version[before.response_mask] == 0).all()
  state = nnx.state(model)
  new_state = jax.tree.map(lambda x: x * 1.05, state)
  compiles = []

  def listener(name, *args, **kwargs):
    if name.endswith('backend_compile_duration'):
      compiles.append(name)

  jax.monitoring.register_event_duration_secs_listener(listener)
  count = compile_count(engine)
  try:
    engine.update_params(new_state)
    after = driver.generate(engine, PROMPTS, **kw)
    # Positive control: the listener does see a compilation.
    jax.jit(lambda x: x + 1)(np.ones(7, np.float32))
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
    engine.update_params(state, version=0)
  # Only the control compiled: neither the engine's steps nor the driver.
  assert compile_count(engine) == count
  assert len(compiles) == 1
  assert (after.policy_version[after.response_mask] == 1).all()
  assert not np.array_equal(before.rollout_logp, after.rollout_logp)


@pytest.mark.parametrize(
  'prompts, new, match',
  [
    ([[1] * (_PF + 1)], 4, 'max_prefill_length'),
    ([[1] * 30], _TL - 29, 'exceed the cache'),
    ([[3], []], 4, 'prompt 1 is empty'),
    ([[3]], 0, 'max_new_tokens'),
  ],
)
def test_bad_requests_are_rejected_clearly(engine, prompts, new, match):
  with pytest.raises(ValueError, match=match):
    driver.generate(engine, prompts, max_new_tokens=new)


def test_engine_keeps_serving_after_a_bad_prefill(engine):
  """A rejected request leaves the live slots' decoding untouched."""
  sp = SamplingParams(top_k=1)

  def run(bad: bool):
    state = engine.init_decode_state()
    padded, n = engine.pad_prompt([5, 6, 7])
    prefix = engine.prefill(
      params=engine.params,
      padded_tokens=padded,
      true_length=n,
      sampling_params=sp,
    )
    state = engine.insert(prefix, state, 0)
    out = []
    for step in range(4):
      if bad and step == 2:
        with pytest.raises(ValueError, match='max_prefill_length'):
          engine.pad_prompt(list(range(_PF + 5)))
        with pytest.raises(ValueError, match='true_length'):
          engine.prefill(
            params=engine.params, padded_tokens=padded, true_length=0
          )
        with pytest.raises(ValueError, match='slot'):
          engine.insert(prefix, state, 3)
      state, result = engine.generate(engine.params, state)
      out.append(int(result.convert_to_numpy().data[0, 0]))
    return out

  assert run(bad=True) == run(bad=False)


def test_engine_sharded_over_four_devices_equals_one(engine, model):
  """Params resharded onto a 4-way tensor mesh: same tokens, log-probs
  within float32 reduction-order noise."""
  from jaxcorr.sharding import MeshConfig, make_mesh

  mesh = make_mesh(MeshConfig(fsdp=1, tensor=4), devices=jax.devices()[:4])
  sharded = PolicyEngine(
    model,
    max_concurrent_decodes=3,
    max_prefill_length=_PF,
    max_target_length=_TL,
    mesh=mesh,
  )
  leaves = jax.tree.leaves(sharded.params)
  assert all(len(x.sharding.device_set) == 4 for x in leaves)
  assert any(not x.sharding.is_fully_replicated for x in leaves)
  kw = dict(num_samples=2, max_new_tokens=8, temperature=0.8, seed=2)
  one = driver.generate(engine, PROMPTS, **kw)
  four = driver.generate(sharded, PROMPTS, **kw)
  np.testing.assert_array_equal(one.response_tokens, four.response_tokens)
  np.testing.assert_allclose(one.rollout_logp, four.rollout_logp, atol=1e-5)


def test_bf16_engine_differs_measurably_but_slightly(engine, model):
  """bf16 params and compute against the float32 trainer on the same
  sequences: a numeric mismatch (allowed), small but not zero."""
  bf16 = PolicyEngine(
    model,
    max_concurrent_decodes=3,
    max_prefill_length=_PF,
    max_target_length=_TL,
    dtype=jnp.bfloat16,
  )
  assert jax.tree.leaves(bf16.params)[0].dtype == jnp.bfloat16
  batch = driver.generate(bf16, PROMPTS, num_samples=2, max_new_tokens=8)
  diffs = []
  for i, q, seq in _sequences(batch, PROMPTS):
    n, p = len(seq) - len(q), len(q)
    padded = jnp.asarray([seq + [0] * (_TL - len(seq))])  # one compile
    ref = np.asarray(logprobs(model, padded))[0, p - 1 : p - 1 + n]
    diffs.append(ref - batch.rollout_logp[i, :n])
  diff = np.concatenate(diffs)  # log π - log μ per token
  # k3 estimator of KL(μ || π) on μ's samples, as rollout_corr/kl reports it.
  kl = float(np.mean(np.exp(diff) - 1 - diff))
  assert np.abs(diff).max() > 1e-4
  assert np.isfinite(kl) and 0 < kl < 1e-2


def test_padded_vocab_is_never_sampled_and_logprobs_still_match():
  """docs/math/rollout_contract.md §1 end to end: with a padded embedding, the
  engine samples only real tokens and its log-probs equal the trainer's masked
  ones."""
  real = 64  # of 128 columns: half the vocabulary is padding
  model = random_model(tiny_config(real_vocab_size=real), seed=5)
  engine = PolicyEngine(
    model, max_concurrent_decodes=2, max_prefill_length=16,
    max_target_length=32,
  )  # fmt: skip
  prompts = [[3, 4, 5], [7, 8]]
  batch = driver.generate(
    engine, prompts, num_samples=4, max_new_tokens=12, temperature=1.5,
    seed=1,
  )  # fmt: skip
  assert int(batch.response_tokens[batch.response_mask].max()) < real
  for i, q, seq in _sequences(batch, prompts):
    n, p = len(seq) - len(q), len(q)
    padded = jnp.asarray([seq + [0] * (32 - len(seq))])  # one compile
    ref = np.asarray(logprobs(model, padded, temperature=1.5))
    np.testing.assert_allclose(
      batch.rollout_logp[i, :n], ref[0, p - 1 : p - 1 + n], atol=1e-5
    )
