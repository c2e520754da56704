"""MoE parity with `transformers` (PyTorch, CPU, float32), both directions.

Tiny random Qwen3-MoE (a dense first layer via `mlp_only_layers`, q/k norm,
re-normalised top-k), Qwen2-MoE (shared expert with its sigmoid gate, q/k/v
bias, plain top-k probabilities, `decoder_sparse_step=2` leaving a dense
layer) and Mixtral (`block_sparse_moe` names, w1/w2/w3):

* `load_hf` -> `token_logprobs` == torch log_softmax(logits / T) within 1e-4;
* `save_hf` -> transformers reload gives the same logits.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.model import load_hf, save_hf
from tests.helpers.model_testing import forward, logprobs

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

VOCAB, SEQ, TEMPERATURE = 96, 16, 0.7
COMMON = dict(
  vocab_size=VOCAB,
  hidden_size=32,
  num_hidden_layers=3,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=64,
  rms_norm_eps=1e-5,
  tie_word_embeddings=False,
)
FAMILIES = {
  'qwen3_moe': (
    'Qwen3MoeConfig',
    'Qwen3MoeForCausalLM',
    dict(
      intermediate_size=48,
      moe_intermediate_size=16,
      num_experts=8,
      num_experts_per_tok=2,
      norm_topk_prob=True,
      mlp_only_layers=[0],
      head_dim=16,
    ),
  ),
  'qwen2_moe': (
    'Qwen2MoeConfig',
    'Qwen2MoeForCausalLM',
    dict(
      intermediate_size=48,
      moe_intermediate_size=16,
      shared_expert_intermediate_size=24,
      num_experts=8,
      num_experts_per_tok=3,
      norm_topk_prob=False,
      decoder_sparse_step=2,
    ),
  ),
  'mixtral': (
    'MixtralConfig',
    'MixtralForCausalLM',
    dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
  ),
}


def hf_moe(family: str, seed: int = 0):
  cfg_cls, model_cls, extra = FAMILIES[family]
  config = getattr(transformers, cfg_cls)(**COMMON, **extra)
  torch.manual_seed(seed)
  model = getattr(transformers, model_cls)(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'norm' in name:
        p.copy_(1 + 0.2 * torch.randn_like(p))
      elif name.endswith('bias'):
        p.copy_(0.2 * torch.randn_like(p))
      elif name.endswith('gate.weight'):  # routers: decisive choices
        p.copy_(0.5 * torch.randn_like(p))
      else:
        p.copy_(0.15 * torch.randn_like(p))
  return model


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.as_tensor(tokens)).logits.numpy()


@pytest.mark.parametrize(
  'family',
  [
    'qwen3_moe',
    # The shared expert, q/k/v bias and a sparse step (slow: the budget).
    pytest.param('qwen2_moe', marks=pytest.mark.slow),
    # Qwen3-MoE's routing math under Mixtral's names (slow: the budget).
    pytest.param('mixtral', marks=pytest.mark.slow),
  ],
)
def test_moe_parity_with_transformers(tmp_path, family):
  ref_model = hf_moe(family)
  ref_model.save_pretrained(tmp_path / 'hf')
  tokens = np.random.default_rng(1).integers(0, VOCAB, (2, SEQ))
  ref = torch_logits(ref_model, tokens)
  assert np.abs(ref).max() > 1.0

  model = load_hf(tmp_path / 'hf')
  cfg = model.config
  assert (cfg.num_experts and len(cfg.moe_layers) < 3) or family == 'mixtral'
  lp = np.asarray(
    logprobs(model, jnp.asarray(tokens), temperature=TEMPERATURE, chunk_size=8)
  )
  ref_lp = torch.log_softmax(torch.as_tensor(ref[:, :-1]) / TEMPERATURE, -1)
  ref_lp = ref_lp.gather(-1, torch.as_tensor(tokens[:, 1:, None]))[..., 0]
  np.testing.assert_allclose(lp, ref_lp.numpy(), atol=1e-4, rtol=0)

  save_hf(model, tmp_path / 'ours')
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'ours')
  assert type(back) is type(ref_model)
  np.testing.assert_allclose(torch_logits(back.eval(), tokens), ref, atol=1e-5)
  # Our own reload of our export is the same model too.
  again = load_hf(tmp_path / 'ours')
  np.testing.assert_allclose(
    np.asarray(forward(again, jnp.asarray(tokens))), ref, atol=1e-4
  )
