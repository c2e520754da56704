"""Parity with `transformers` (PyTorch, CPU, float32).

Tiny random LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM, tied and
untied, with and without Llama-3 RoPE scaling, saved with `save_pretrained`:

* `load_hf` logits == torch logits within 1e-4;
* `token_logprobs` == torch log_softmax(logits / T) at the tokens, same T;
* `save_hf` output reloads in transformers with the same logits.

Weights are re-drawn larger than HF's init (std 0.02 would make every logit
~0 and any bug invisible), norms and biases randomised, and the sequence is
longer than the RoPE scaling's original context, so every feature is live.
Skipped when torch / transformers are not installed (CI installs them).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.model import load_hf, save_hf
from tests.helpers.model_testing import forward, logprobs

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

VOCAB, SEQ, TEMPERATURE = 160, 48, 0.7
LLAMA3_SCALING = dict(
  rope_type='llama3',
  factor=8.0,
  low_freq_factor=1.0,
  high_freq_factor=4.0,
  original_max_position_embeddings=16,
)


def hf_model(
  family: str, tied: bool, scaling: bool, seed: int = 0, std=0.15, **sizes
):
  cls = {
    'llama': (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    'qwen2': (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    'qwen3': (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
  }[family]
  kw = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=tied,
  )
  if family == 'qwen3':
    kw['head_dim'] = 32  # != hidden / heads, as in real Qwen3 configs
  kw.update(sizes)
  theta = 500_000.0 if scaling else 10_000.0
  if scaling:
    kw['rope_scaling'] = dict(LLAMA3_SCALING, rope_theta=theta)
  kw['rope_theta'] = theta
  config = cls[0](**kw)
  torch.manual_seed(seed)
  model = cls[1](config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'norm' in name:
        p.copy_(1 + 0.2 * torch.randn_like(p))
      elif name.endswith('bias'):
        p.copy_(0.2 * torch.randn_like(p))
      else:
        p.copy_(std * torch.randn_like(p))
  return model


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.as_tensor(tokens)).logits.numpy()


def torch_logprobs(logits: np.ndarray, tokens: np.ndarray, temp: float):
  lp = torch.log_softmax(torch.as_tensor(logits[:, :-1]) / temp, dim=-1)
  return lp.gather(-1, torch.as_tensor(tokens[:, 1:, None]))[..., 0].numpy()


CASES = [
  # family, tied, llama-3 scaling, scan_layers
  ('llama', False, True, False),
  ('llama', True, False, True),
  ('qwen2', True, False, False),
  ('qwen2', False, True, True),
  ('qwen3', True, True, False),
  ('qwen3', False, False, True),
]


@pytest.mark.parametrize('family, tied, scaling, scan', CASES)
def test_parity_with_transformers(tmp_path, family, tied, scaling, scan):
  ref_model = hf_model(family, tied, scaling)
  ref_model.save_pretrained(tmp_path / 'hf')
  tokens = np.random.default_rng(1).integers(0, VOCAB, (2, SEQ))
  ref = torch_logits(ref_model, tokens)
  assert np.abs(ref).max() > 1.0  # logits that can show a bug

  model = load_hf(tmp_path / 'hf', scan_layers=scan)
  assert model.config.tie_embeddings == tied
  assert (model.config.rope_scaling is not None) == scaling
  logits = np.asarray(forward(model, jnp.asarray(tokens)))
  np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=0)

  lp = np.asarray(
    logprobs(model, jnp.asarray(tokens), temperature=TEMPERATURE, chunk_size=16)
  )
  np.testing.assert_allclose(
    lp, torch_logprobs(ref, tokens, TEMPERATURE), atol=1e-4, rtol=0
  )

  if scaling:  # the scaling is really exercised
    plain = load_hf(tmp_path / 'hf', rope_scaling=None)
    assert (
      np.abs(np.asarray(forward(plain, jnp.asarray(tokens))) - ref).max() > 1e-2
    )

  save_hf(model, tmp_path / 'ours', max_shard_bytes=60_000)
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'ours')
  assert type(back) is type(ref_model)
  np.testing.assert_allclose(torch_logits(back.eval(), tokens), ref, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize('family', ['llama', 'qwen2', 'qwen3'])
def test_parity_larger_model_long_sequence(tmp_path, family):
  """4 layers, D=256, 8 heads over 2 KV heads, 512 tokens: within 1e-4 of
  torch fp32, and no further from a float64 torch run than torch fp32 is."""
  sizes = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=1024,
  )
  if family == 'qwen3':
    sizes['head_dim'] = 64
  ref_model = hf_model(
    family, tied=family == 'qwen2', scaling=True, std=0.08, **sizes
  )
  ref_model.save_pretrained(tmp_path)
  tokens = np.random.default_rng(2).integers(0, VOCAB, (2, 512))
  ref = torch_logits(ref_model, tokens)
  ref64 = torch_logits(ref_model.double(), tokens)
  model = load_hf(tmp_path, scan_layers=True)
  logits = np.asarray(forward(model, jnp.asarray(tokens)))
  np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=0)
  assert np.abs(logits - ref64).max() <= max(
    2e-5, 2 * np.abs(ref - ref64).max()
  )
  lp = logprobs(model, jnp.asarray(tokens), temperature=1.3)
  np.testing.assert_allclose(lp, torch_logprobs(ref, tokens, 1.3), atol=1e-4)
