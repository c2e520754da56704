"""Exact mode (`rollout.exact`, jaxcorr/model/exact.py): the engine's μ equals
the trainer's π_old bit for bit (`np.array_equal`) on every response token,
whatever the slot count, the submission order, the prompt lengths, the
decode chunk and prefill vs decode; the tokens are drawn from those logits.

The trainer's side is the real one: `batch.assemble` lays the rows out
(left-padded prompts), `scoring.exact_logp` scores them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcorr.model import exact as exact_lib
from jaxcorr.model.lora import LoraConfig, apply_lora
from jaxcorr.rollout import driver
from jaxcorr.rollout.engine import PolicyEngine, SamplingParams
from jaxcorr.train import batch as batch_lib
from jaxcorr.train import build, scoring
from tests.helpers.model_testing import random_model, tiny_config
from tests.helpers.trainer_config import pulse_config

PROMPTS = [[3, 4, 5], list(range(10, 24)), [7], [9] * 9, [20, 21, 22, 23]]
_PF, _NEW = 16, 10
_TL = _PF + _NEW


LORA = LoraConfig(rank=4, alpha=8.0, target_modules='q_proj,v_proj,up_proj')


def _run(dtype, lora=None):
  """A RunConfig whose engine has the test engine's cache length."""
  c = pulse_config()
  c.rollout.exact = True
  c.rollout.engine_dtype = dtype
  c.rollout.max_prompt_length = _PF
  c.rollout.max_new_tokens = _NEW
  if lora is not None:
    c.lora.rank, c.lora.alpha = lora.rank, lora.alpha
    c.lora.target_modules = ','.join(lora.target_modules)
    c.lora.engine_merged = lora.engine_merged
    c.train.sft_steps = 0
  return build.build(c)


@functools.cache
def _model():
  """The trainer's policy: float32."""
  return random_model(tiny_config())


@functools.cache
def _engine(dtype, slots, chunk=4):
  """One engine per setting for the whole module (each compiles its own
  programs: ~15 s on a busy CPU), computing in `dtype`."""
  return PolicyEngine(
    _model(),
    dtype=jnp.dtype(dtype),
    max_concurrent_decodes=slots,
    max_prefill_length=_PF,
    max_target_length=_TL,
    decode_chunk=chunk,
    exact=True,
  )


def _generate(engine, prompts, **kw):
  return driver.generate(
    engine,
    prompts,
    num_samples=2,
    max_new_tokens=_NEW,
    temperature=0.8,
    seed=5,
    **kw,
  )


def _trainer_logp(dtype, rollouts, model=None, lora=None, routing=False):
  """π_old [B, T] of the rollouts, the trainer's way (assemble + score),
  and the response mask (and with `routing` the MoE routing and the
  trainer batch)."""
  run = _run(dtype, lora)
  tb = batch_lib.assemble(
    rollouts,
    np.zeros(rollouts.batch_size, np.float32),
    trainer_version=0,
    max_staleness=None,
    logprob_mode='full',
    row_multiple=1,
  )
  graphdef, params = nnx.split(model or _model())
  score = jax.jit(
    functools.partial(scoring.exact_logp, run, graphdef, routing=routing)
  )
  out = score(params, tb)
  if routing:
    return np.asarray(out[0]), tb.response_mask, np.asarray(out[1]), tb
  return np.asarray(out), tb.response_mask


def _assert_exact(dtype, rollouts, **policy):
  logp, mask = _trainer_logp(dtype, rollouts, **policy)
  assert mask.sum() > 40 and (mask.sum(1) > 1).all()
  assert np.array_equal(logp[mask], rollouts.rollout_logp[mask])


def test_mu_equals_pi_old_bit_for_bit_whatever_the_slots():
  """float32, 3 slots and chunks of 4 against 8 slots and chunks of 1:
  the same tokens and μ; shuffled submission (other keys, other samples)
  too; μ == π_old on every response token (the first from prefill, the
  rest from decode steps, prompts of 1 to 14 tokens)."""
  base = _generate(_engine('float32', 3), PROMPTS)
  wide = _engine('float32', 8, chunk=1)
  again = _generate(wide, PROMPTS)
  np.testing.assert_array_equal(again.response_tokens, base.response_tokens)
  assert np.array_equal(again.rollout_logp, base.rollout_logp)
  shuffled = _generate(wide, [PROMPTS[i] for i in (3, 0, 4, 2, 1)])
  for r in (base, shuffled):
    _assert_exact('float32', r)


def test_mu_equals_pi_old_bit_for_bit_with_a_bfloat16_engine():
  """A bfloat16 engine under a float32 trainer: π_old is scored as the
  engine holds the policy (cast to bfloat16, `scoring.engine_model`)."""
  _assert_exact('bfloat16', _generate(_engine('bfloat16', 3), PROMPTS))


@pytest.mark.parametrize('merged', [True, False])
def test_lora_engine_merged_or_not(merged):
  """A LoRA policy (adapters nonzero): the unmerged engine runs the LoRA
  graph as the trainer does; the merged one is matched by scoring π_old
  with the adapters merged as the engine merges them."""
  lora = LoraConfig(**{**vars(LORA), 'engine_merged': merged})
  model = apply_lora(random_model(tiny_config()), lora)
  rng = np.random.default_rng(1)
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    if path[-1] == 'lora_b':
      var.set_value(jnp.asarray(0.3 * rng.normal(size=var.shape), jnp.float32))
  engine = PolicyEngine(
    model,
    max_concurrent_decodes=3,
    max_prefill_length=_PF,
    max_target_length=_TL,
    lora=lora,
    exact=True,
  )
  _assert_exact('float32', _generate(engine, PROMPTS), model=model, lora=lora)


def test_moe_engine_records_the_exact_routing():
  """An MoE policy (Qwen3-MoE shaped, a dense first layer): μ == π_old,
  and the routing the engine records for R3 is the trainer's exact
  forward's on every token it fed (prompt and response)."""
  cfg = tiny_config(
    architecture='Qwen3MoeForCausalLM',
    qkv_bias=False,
    qk_norm=True,
    moe_intermediate_size=16,
    num_experts=8,
    num_experts_per_tok=2,
    mlp_only_layers=(0,),
  )
  model = random_model(cfg)
  engine = PolicyEngine(
    model,
    max_concurrent_decodes=3,
    max_prefill_length=_PF,
    max_target_length=_TL,
    exact=True,
  )
  rollouts = _generate(engine, PROMPTS)
  logp, mask, experts, tb = _trainer_logp(
    'float32', rollouts, model=model, routing=True
  )
  assert np.array_equal(logp[mask], rollouts.rollout_logp[mask])
  recorded = np.asarray(tb.routed_experts)
  fed = recorded[..., 0, 0] >= 0
  assert fed.sum() > 40 and (fed <= np.asarray(tb.segment_ids != 0)).all()
  assert np.array_equal(recorded[fed], experts[fed])


def test_a_recomputed_cache_is_the_same_bits():
  """`kv_on_update='recompute'` (`refresh_cache`): the exact prefill of
  each slot's context rewrites its cache with the bits decoding wrote."""
  engine = _engine('float32', 3)
  prompts = PROMPTS[:3]
  keys = driver.request_keys(0, 0, len(prompts), 1)
  sp = SamplingParams(temperature=0.8)
  prefix = engine.prefill_batch(engine.params, prompts, [0, 1, 2], keys, sp)
  stop = engine.stop_array([])
  state = engine.insert_batch(
    prefix, engine.init_decode_state(), [0, 1, 2], [_NEW] * 3, stop
  )
  state, chunk = engine.decode_chunk(state, stop)
  counts = np.asarray(chunk.counts)
  first, sampled = np.asarray(prefix.token), np.asarray(chunk.tokens)
  contexts = [
    [*q, int(first[i]), *sampled[i, : counts[i] - 1].tolist()]
    for i, q in enumerate(prompts)
  ]
  written = [len(c) for c in contexts]
  assert written == np.asarray(state.cache.index).tolist()
  before = [np.asarray(c) for c in state.cache.k + state.cache.v]
  state = engine.refresh_cache(state, contexts)
  after = [np.asarray(c) for c in state.cache.k + state.cache.v]
  for b, a in zip(before, after):
    for i, n in enumerate(written):
      assert np.array_equal(b[i, :, :n], a[i, :, :n])


@nnx.jit
def _exact_argmax(model, tokens):
  """Greedy tokens [B, L] of right-padded rows under the exact forward."""
  b, length = tokens.shape
  pos = jnp.tile(jnp.arange(length), b)
  row = jnp.repeat(jnp.arange(b), length)
  store = exact_lib.empty_store(model.config, b, _TL)
  tokens = tokens.reshape(-1)
  hidden, _, _ = exact_lib.exact_hidden(model, tokens, pos, row, store)
  z, _ = exact_lib.exact_logits(model, hidden, jnp.ones(b * length))
  return jnp.argmax(z, axis=-1).reshape(b, length)


def test_tokens_are_drawn_from_the_exact_logits():
  """Greedy decoding picks the argmax of the exact logits at each position
  (what was sampled is what μ describes)."""
  rollouts = _generate(_engine('float32', 3), PROMPTS, top_k=1)
  seqs = []
  for i in range(rollouts.batch_size):
    n = int(rollouts.response_mask[i].sum())
    seqs.append(
      PROMPTS[rollouts.group_id[i]] + rollouts.response_tokens[i, :n].tolist()
    )
  tokens = np.zeros((len(seqs), _TL), np.int32)
  for i, seq in enumerate(seqs):
    tokens[i, : len(seq)] = seq
  greedy = np.asarray(_exact_argmax(_model(), jnp.asarray(tokens)))
  for i, seq in enumerate(seqs):
    p = len(PROMPTS[rollouts.group_id[i]])
    assert greedy[i, p - 1 : len(seq) - 1].tolist() == seq[p:], i


def test_log_probs_do_not_depend_on_the_key_extent():
  """The same rows scored over stores of 11 and 97 positions: the same
  bits. What lets attention run only the key blocks up to a tile's last
  position (a prompt's prefill, a short row) instead of the whole cache,
  and stay exact."""
  seqs = (list(range(3, 14)), [7, 8], [9] * 6)
  rows, segs = np.zeros((3, 11), np.int32), np.zeros((3, 11), np.int32)
  for i, seq in enumerate(seqs):
    rows[i, : len(seq)], segs[i, : len(seq)] = seq, 1
  score = nnx.jit(exact_lib.exact_token_logprobs, static_argnums=4)
  short, long = (
    np.asarray(score(_model(), rows, segs, jnp.full((3,), 0.8), s)[0])
    for s in (11, 97)
  )
  real = segs[:, 1:] == 1
  assert np.array_equal(short[real], long[real])


def test_exact_mode_is_refused_where_it_cannot_hold():
  model = _model()
  with pytest.raises(ValueError, match='kv_cache_dtype'):
    PolicyEngine(
      model,
      max_concurrent_decodes=2,
      max_prefill_length=_PF,
      max_target_length=_TL,
      kv_cache_dtype='int8',
      exact=True,
    )
  for field, value in (
    ('quantization', 'int8'),
    ('logprob_mode', 'replay'),
    ('kv_cache_dtype', 'int8'),
  ):
    c = pulse_config()
    c.rollout.exact = True
    c.rollout[field] = value
    with pytest.raises(ValueError, match=f'config.rollout.{field}: .*exact'):
      build.build(c)
