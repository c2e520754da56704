"""The Transformer without any reference framework: config, RoPE scaling,
packing, chunked log-probs, KV-cache decoding, remat / scan-over-layers and
compute dtypes. (Parity with transformers: tests/model/test_hf_parity.py.)"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcorr.model import (
  RopeScaling,
  Transformer,
  TransformerConfig,
  UnsupportedModelError,
  layers,
  logprobs_from_hidden,
  naive_token_logprobs,
  segment_positions,
  token_logprobs,
)
from jaxcorr.model.layers import rope_frequencies
from jaxcorr.model.logprobs import lse_and_entropy, remat_chunks
from tests.helpers.model_testing import (
  VOCAB,
  forward,
  hidden,
  logprobs,
  naive_logprobs,
  random_model,
  random_tokens,
  stack_layers,
  tiny_config,
  with_config,
)

# ------------------------------------------------------------------ config


def test_config_is_hashable_and_normalised():
  cfg = tiny_config(param_dtype='bfloat16')
  assert cfg.head_dim == 8 and cfg.num_groups == 4
  assert cfg.param_dtype == jnp.bfloat16 and cfg.dtype == jnp.float32
  assert hash(cfg) == hash(tiny_config(param_dtype=jnp.bfloat16))
  assert tiny_config(eos_token_id=[1, 2]).eos_token_id == (1, 2)
  with pytest.raises(ValueError, match='multiple of num_kv_heads'):
    tiny_config(num_kv_heads=3)
  with pytest.raises(ValueError, match='remat'):
    tiny_config(remat='sometimes')
  with pytest.raises(UnsupportedModelError):
    tiny_config(architecture='GPT2LMHeadModel')


@pytest.mark.parametrize(
  'changes',
  [
    dict(),
    dict(tie_embeddings=True, qkv_bias=False),
    dict(
      architecture='Qwen3ForCausalLM', qk_norm=True, head_dim=16, qkv_bias=False
    ),
    dict(qkv_bias=True, o_bias=True),
  ],
)
def test_num_params_counts_every_param(changes):
  cfg = tiny_config(**changes)
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  total = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert cfg.num_params() == total


HF_LLAMA = dict(
  architectures=['LlamaForCausalLM'],
  vocab_size=256,
  hidden_size=64,
  intermediate_size=96,
  num_hidden_layers=3,
  num_attention_heads=4,
  num_key_value_heads=2,
  rms_norm_eps=1e-5,
  hidden_act='silu',
  tie_word_embeddings=False,
)


def test_from_hf_config_reads_both_rope_spellings():
  scaling = dict(
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
  )
  v4 = dict(
    HF_LLAMA, rope_theta=5e5, rope_scaling=dict(type='llama3', **scaling)
  )
  v5 = dict(
    HF_LLAMA,
    rope_parameters=dict(rope_type='llama3', rope_theta=5e5, **scaling),
  )
  a, b = (
    TransformerConfig.from_hf_config(v4),
    TransformerConfig.from_hf_config(v5),
  )
  assert a == b
  assert a.rope_theta == 5e5 and a.rope_scaling == RopeScaling(**scaling)
  assert (a.head_dim, a.num_kv_heads, a.rms_norm_eps) == (16, 2, 1e-5)
  assert not (a.qkv_bias or a.o_bias or a.qk_norm or a.tie_embeddings)
  plain = TransformerConfig.from_hf_config(dict(HF_LLAMA, rope_theta=1e4))
  assert plain.rope_scaling is None and plain.rope_theta == 1e4


def test_from_hf_config_family_switches():
  qwen2 = dict(
    HF_LLAMA, architectures=['Qwen2ForCausalLM'], tie_word_embeddings=True
  )
  cfg = TransformerConfig.from_hf_config(qwen2)
  assert (
    cfg.qkv_bias and not cfg.o_bias and not cfg.qk_norm and cfg.tie_embeddings
  )
  qwen3 = dict(HF_LLAMA, architectures=['Qwen3ForCausalLM'], head_dim=32)
  cfg = TransformerConfig.from_hf_config(qwen3)
  assert cfg.qk_norm and not cfg.qkv_bias and cfg.head_dim == 32
  llama_bias = dict(HF_LLAMA, attention_bias=True)
  cfg = TransformerConfig.from_hf_config(llama_bias)
  assert cfg.qkv_bias and cfg.o_bias
  overridden = TransformerConfig.from_hf_config(
    HF_LLAMA, param_dtype='bfloat16', scan_layers=True
  )
  assert overridden.param_dtype == jnp.bfloat16 and overridden.scan_layers


@pytest.mark.parametrize(
  'change, match',
  [
    (
      dict(architectures=['MistralForCausalLM'], model_type='mistral'),
      'Mistral',
    ),
    (dict(hidden_act='gelu'), 'hidden_act'),
    (dict(mlp_bias=True), 'mlp_bias'),
    (dict(use_sliding_window=True), 'sliding'),
    (dict(rope_scaling=dict(rope_type='yarn', factor=4.0)), 'yarn'),
    (dict(partial_rotary_factor=0.5), 'partial_rotary'),
  ],
)
def test_from_hf_config_refuses_what_it_cannot_run(change, match):
  with pytest.raises(UnsupportedModelError, match=match):
    TransformerConfig.from_hf_config(dict(HF_LLAMA, **change))


def test_from_hf_config_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match='config'):
    TransformerConfig.from_hf_config(tmp_path)


@pytest.mark.parametrize(
  'arch', ['LlamaForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM']
)
def test_hf_config_round_trip(arch):
  hf = dict(HF_LLAMA, architectures=[arch], rope_theta=1e6, eos_token_id=[3, 4])
  cfg = TransformerConfig.from_hf_config(hf)
  assert TransformerConfig.from_hf_config(cfg.to_hf_config()) == cfg


# -------------------------------------------------------------------- RoPE


def test_llama3_rope_scaling_bands():
  s = RopeScaling(8.0, 1.0, 4.0, 64)
  base = rope_frequencies(32, 5e5, None)
  scaled = rope_frequencies(32, 5e5, s)
  wavelen = 2 * np.pi / base
  high = wavelen < 64 / 4  # short wavelengths: untouched
  low = wavelen > 64 / 1  # long wavelengths: divided by the factor
  mid = ~high & ~low
  assert high.any() and low.any() and mid.any()
  np.testing.assert_array_equal(scaled[high], base[high])
  np.testing.assert_allclose(scaled[low], base[low] / 8, rtol=1e-6)
  assert np.all(scaled[mid] < base[mid]) and np.all(scaled[mid] > base[mid] / 8)
  assert scaled.dtype == np.float32


# ----------------------------------------------------------------- packing


def test_segment_positions_restart_per_segment():
  seg = jnp.array([[1, 1, 1, 2, 2, 3, 0, 0], [5, 5, 5, 5, 5, 5, 5, 5]])
  np.testing.assert_array_equal(
    segment_positions(seg),
    [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]],
  )


@pytest.mark.parametrize(
  'scan', [False, pytest.param(True, marks=pytest.mark.slow)]
)
def test_packed_sequences_equal_separate_runs(scan):
  model = with_config(random_model(tiny_config()), scan_layers=scan)
  lengths = (7, 12, 5)
  seqs = [random_tokens(1, n, seed=10 + i)[0] for i, n in enumerate(lengths)]
  pad = 4
  packed = jnp.concatenate([*seqs, jnp.zeros(pad, jnp.int32)])[None]
  seg = jnp.concatenate(
    [jnp.full(n, i + 1) for i, n in enumerate(lengths)] + [jnp.zeros(pad)]
  ).astype(jnp.int32)[None]
  h_packed = hidden(model, packed, seg)[0]
  start = 0
  for s in seqs:
    n = s.shape[0]
    h = hidden(model, s[None])[0]
    np.testing.assert_allclose(h_packed[start : start + n], h, atol=1e-5)
    start += n
  # Not vacuous: without segment ids the second sequence sees the first.
  h_unpacked = hidden(model, packed)[0]
  assert np.abs(h_unpacked[7:19] - h_packed[7:19]).max() > 1e-2


# ------------------------------------------------------------- log-probs


@pytest.mark.parametrize('chunk', [1, 7, 64])
def test_chunked_logprobs_equal_naive(chunk):
  model = random_model(tiny_config())
  tokens = random_tokens(3, 24)
  temp = jnp.array([1.0, 0.6, 1.7])
  lp, ent = logprobs(
    model, tokens, temperature=temp, chunk_size=chunk, return_entropy=True
  )
  lp_n, ent_n = naive_logprobs(
    model, tokens, temperature=temp, return_entropy=True
  )
  assert lp.shape == ent.shape == (3, 23) and lp.dtype == jnp.float32
  np.testing.assert_allclose(lp, lp_n, atol=2e-6)
  np.testing.assert_allclose(ent, ent_n, atol=5e-6)
  assert np.all(lp <= 0) and np.all(ent >= 0) and np.all(ent <= np.log(VOCAB))
  # Temperature matters (the per-row values are really used).
  lp_1 = logprobs(model, tokens, chunk_size=chunk)
  np.testing.assert_allclose(lp[0], lp_1[0], atol=2e-6)
  assert np.abs(lp[1:] - lp_1[1:]).min() > 0


def test_chunked_logprob_gradients_equal_naive():
  model = random_model(tiny_config())
  tokens = random_tokens(2, 20)
  weights = jax.random.normal(jax.random.key(3), (2, 19))

  def loss(fn, **kw):
    def f(m):
      lp, ent = fn(m, tokens, temperature=0.9, return_entropy=True, **kw)
      return jnp.sum(weights * lp) + 0.1 * jnp.sum(ent)

    return f

  g_chunk = nnx.jit(nnx.grad(loss(token_logprobs, chunk_size=6)))(model)
  g_naive = nnx.jit(nnx.grad(loss(naive_token_logprobs)))(model)
  flat_c = jax.tree.leaves(g_chunk)
  flat_n = jax.tree.leaves(g_naive)
  assert len(flat_c) == len(flat_n) > 10
  for a, b in zip(flat_c, flat_n):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_lse_and_entropy_match_numpy_with_masked_columns_and_big_shifts():
  """The one-exp logsumexp and entropy equal float64 NumPy's, stay exact
  under a large common shift of the logits (z − m, not z, is summed), give
  -inf columns no mass, and differentiate like softmax: ∂H/∂z = −p(z − Ez)."""
  rng = np.random.default_rng(0)
  z = rng.normal(0, 3, (4, 5, 50)).astype(np.float32)
  z[0, :, 40:] = -np.inf  # a padded vocabulary's columns
  z[1] += 1e3
  lse, ent = jax.jit(lse_and_entropy)(jnp.asarray(z))
  z64 = z.astype(np.float64)
  m = z64.max(-1, keepdims=True)
  want_lse = m[..., 0] + np.log(np.exp(z64 - m).sum(-1))
  p = np.exp(z64 - want_lse[..., None])
  want_ent = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), -1)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
  np.testing.assert_allclose(ent, want_ent, atol=2e-6)
  w = rng.normal(size=(4, 5))
  g = jax.grad(lambda z: jnp.sum(w * lse_and_entropy(z)[1]))(jnp.asarray(z))
  mean = np.sum(np.where(p > 0, p * np.where(p > 0, z64, 0), 0), -1)
  want_g = -w[..., None] * p * np.where(p > 0, z64 - mean[..., None], 0)
  assert np.all(np.isfinite(g)) and np.all(np.asarray(g)[0, :, 40:] == 0)
  np.testing.assert_allclose(g, want_g, atol=2e-5)


def test_logprob_remat_modes_give_the_same_values_and_gradients():
  """`remat='never'` (the chunks' logits kept for the backward pass) and
  'auto' compute what the checkpointed chunks ('always') compute: the
  log-probs, the entropy and every gradient (entropy term included)."""
  model = random_model(tiny_config())
  tokens = random_tokens(2, 20)
  weights = jax.random.normal(jax.random.key(3), (2, 19))

  def value_and_grad(remat):
    def f(m):
      lp, ent = token_logprobs(
        m, tokens, temperature=0.9, return_entropy=True, chunk_size=6,
        remat=remat,
      )  # fmt: skip
      return jnp.sum(weights * lp) + 0.1 * jnp.sum(ent), (lp, ent)

    return nnx.jit(nnx.value_and_grad(f, has_aux=True))(model)

  (v0, aux0), g0 = value_and_grad('always')
  for mode in ('never', 'auto'):
    (v, aux), g = value_and_grad(mode)
    np.testing.assert_allclose(v, v0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves((aux, g)), jax.tree.leaves((aux0, g0))):
      np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)


def test_remat_chunks_auto_checkpoints_only_big_logits():
  assert not remat_chunks('auto', 8, 128, 4096)  # 16 MiB of logits
  # configs/smollm2_arith.py's micro-batch (396 MB): kept, 6-9% faster.
  assert not remat_chunks('auto', 32, 63, 49152)
  assert remat_chunks('auto', 8, 1024, 49152)  # 1.5 GiB
  assert remat_chunks('always', 1, 1, 1) and not remat_chunks('never', 9, 9, 9)
  with pytest.raises(ValueError, match='expected one of'):
    remat_chunks('sometimes', 1, 1, 1)


def test_logprobs_from_hidden_rejects_bad_temperature():
  with pytest.raises(ValueError, match='temperature'):
    logprobs_from_hidden(
      jnp.zeros((2, 3, 4)),
      jnp.zeros((5, 4)),
      jnp.zeros((2, 3), int),
      temperature=jnp.ones(3),
    )


# ---------------------------------------------------------------- decoding


@pytest.mark.parametrize('scan', [False, True])
def test_kv_cache_decoding_matches_full_forward(scan):
  model = with_config(random_model(tiny_config()), scan_layers=scan)
  tokens = random_tokens(2, 14)
  full = forward(model, tokens)

  @nnx.jit
  def step(model, tokens, cache):
    h, cache = model.hidden_states(tokens, cache=cache)
    return model.logits(h), cache

  cache = model.init_cache(batch=2, max_len=16)
  logits, cache = step(model, tokens[:, :9], cache)  # prefill
  steps = [logits]
  logits, cache = step(model, tokens[:, 9:11], cache)  # two tokens at once
  steps.append(logits)
  for i in range(11, 14):
    logits, cache = step(model, tokens[:, i : i + 1], cache)
    steps.append(logits)
  assert int(cache.index) == 14
  np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=2e-5)


# ------------------------------------------------- remat, scan and dtypes


def _loss_and_grads(model, tokens):
  def loss(m):
    return token_logprobs(m, tokens, chunk_size=8).mean()

  return nnx.jit(nnx.value_and_grad(loss))(model)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_one_query_attention_equals_the_general_path(dtype):
  """Decode attention (one query against the cache, layers._attend_one,
  broadcast multiply + reduce) equals the einsum path of `attend` on the
  same inputs in the [B, T, K, Dh] layout, padding masked out."""
  b, t, h, kv, dh = 3, 11, 8, 2, 16
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (b, 1, h, dh)).astype(dtype)
  k = jax.random.normal(keys[1], (b, kv, t, dh)).astype(dtype)
  v = jax.random.normal(keys[2], (b, kv, t, dh)).astype(dtype)
  mask = jnp.arange(t)[None, None, :] < jnp.array([11, 4, 1])[:, None, None]
  got = layers.attend(q, k, v, mask, heads_first=True)
  ref = layers.attend(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask)
  assert got.shape == ref.shape == (b, 1, h, dh) and got.dtype == dtype
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(
    np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=tol
  )
  # A masked slot changes nothing: row 2 sees only slot 0.
  v2 = v.at[2, :, 1:].set(100)
  got2 = layers.attend(q, k, v2, mask, heads_first=True)
  np.testing.assert_array_equal(np.asarray(got2[2]), np.asarray(got[2]))


def _reference_attention(q, k, v, mask):
  """The textbook GQA formula, differentiated by autodiff."""
  g = q.shape[2] // k.shape[2]
  k, v = (jnp.repeat(x, g, axis=2) for x in (k, v))
  scores = jnp.einsum('bshd,bthd->bhst', q, k) * q.shape[-1] ** -0.5
  scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
  return jnp.einsum('bhst,bthd->bshd', jax.nn.softmax(scores, -1), v)


def test_attention_gradients_equal_autodiff_of_the_formula():
  """`attend`'s written-out backward (layers._grouped_attention) equals
  autodiff of the plain formula, a fully masked (padding) row included."""
  b, s, h, kv, dh = 3, 7, 6, 2, 8
  keys = jax.random.split(jax.random.key(1), 4)
  q = jax.random.normal(keys[0], (b, s, h, dh))
  k = jax.random.normal(keys[1], (b, s, kv, dh))
  v = jax.random.normal(keys[2], (b, s, kv, dh))
  cot = jax.random.normal(keys[3], (b, s, h, dh))
  causal = jnp.tril(jnp.ones((s, s), bool))
  mask = jnp.stack(
    [causal, causal & (jnp.arange(s) < 4), causal.at[5].set(False)]
  )

  def vjp(f):
    out, pull = jax.vjp(lambda *a: f(*a, mask), q, k, v)
    return (out, *pull(cot))

  got = jax.jit(lambda: vjp(layers.attend))()
  want = vjp(_reference_attention)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_remat_and_scan_give_same_values_and_gradients():
  base = random_model(tiny_config())
  tokens = random_tokens(2, 16)
  ref_loss, ref_grads = _loss_and_grads(base, tokens)
  ref = stack_layers(ref_grads)
  # Both remat code paths (per-layer split/merge, scan body) and policies;
  # scan + 'dots' is what configs/smollm2_arith.py runs.
  for changes in (
    dict(remat='dots'),
    dict(scan_layers=True, remat='full'),
    dict(scan_layers=True, remat='dots'),
  ):
    model = with_config(base, **changes)
    loss, grads = _loss_and_grads(model, tokens)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    got = stack_layers(grads)
    assert got.keys() == ref.keys()
    for k in ref:
      np.testing.assert_allclose(
        got[k], ref[k], atol=1e-6, err_msg=f'{changes} {k}'
      )


def test_scan_params_are_stacked_with_a_layers_axis():
  cfg = tiny_config(scan_layers=True)
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  q = model.layers.attn.q_proj.kernel
  assert q.shape == (2, 64, 8, 8)
  assert q.get_metadata()['logical_axes'] == (
    'layers',
    'embed',
    'heads',
    'head_dim',
  )


@pytest.mark.parametrize('param_dtype', ['float32', 'bfloat16'])
def test_bf16_compute_is_close_to_fp32(param_dtype):
  base = random_model(tiny_config())
  tokens = random_tokens(2, 16)
  ref = logprobs(base, tokens)
  model = with_config(base, param_dtype=param_dtype, dtype='bfloat16')
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert {x.dtype for x in leaves} == {jnp.dtype(param_dtype)}
  lp = logprobs(model, tokens)
  assert lp.dtype == jnp.float32
  err = np.abs(lp - ref)
  assert 0 < err.max() < 0.25 and err.mean() < 0.05


def test_matmul_precision_field_is_accepted():
  base = random_model(tiny_config())
  tokens = random_tokens(1, 8)
  model = with_config(base, matmul_precision='highest')
  np.testing.assert_allclose(
    forward(model, tokens), forward(base, tokens), atol=1e-5
  )
  assert dataclasses.replace(model.config, matmul_precision=None) == base.config


def test_padded_vocab_columns_are_minus_inf_for_trainer_and_entropy():
  """docs/math/rollout_contract.md §1: logit columns past the tokenizer's real
  vocabulary are -inf, so log-probs and entropy are those of the real-token
  softmax."""
  real = VOCAB - 28
  model = random_model(tiny_config(real_vocab_size=real), seed=3)
  full = random_model(tiny_config(), seed=3)  # same weights, no masking
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, real, (2, 12)))
  z = forward(full, tokens)[:, :-1] / 0.8
  assert np.all(np.isneginf(np.asarray(forward(model, tokens))[..., real:]))
  want = jax.nn.log_softmax(z[..., :real], axis=-1)
  want_lp = jnp.take_along_axis(want, tokens[:, 1:, None], -1)[..., 0]
  want_ent = -jnp.sum(jnp.exp(want) * want, axis=-1)
  for fn in (logprobs, naive_logprobs):
    lp, ent = fn(model, tokens, temperature=0.8, return_entropy=True)
    np.testing.assert_allclose(lp, want_lp, atol=1e-5)
    np.testing.assert_allclose(ent, want_ent, atol=1e-5)
  grad = jax.grad(
    lambda h: logprobs_from_hidden(
      h, model.head_weight(), tokens[:, 1:], return_entropy=True,
      real_vocab_size=real,
    )[1].sum()
  )(hidden(model, tokens)[:, :-1])  # fmt: skip
  assert np.all(np.isfinite(grad))
  with pytest.raises(ValueError, match='real_vocab_size'):
    tiny_config(real_vocab_size=VOCAB + 1)
