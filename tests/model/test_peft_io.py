"""A LoRA policy written as a PEFT directory (jaxcorr/model/peft_io.py)
loads with `peft.PeftModel.from_pretrained` onto the transformers base
(written by `save_hf`) with the same logits as jaxcorr's, in float32;
MoE expert adapters too (per-expert keys, converted by PEFT onto
transformers' fused experts), and what PEFT cannot load is refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jaxcorr.model import Transformer, TransformerConfig, load_hf, save_hf
from jaxcorr.model.lora import (
  TARGETS,
  LoraConfig,
  apply_lora,
  plain_pure,
  split_adapter,
)
from jaxcorr.model.peft_io import (
  peft_refusal,
  peft_tensors,
  save_peft,
  target_modules,
)
from tests.helpers.model_testing import forward, random_model, tiny_config

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')
peft = pytest.importorskip('peft')


@pytest.mark.slow
@pytest.mark.parametrize('scan', [False, True])
def test_peft_adapter_loads_with_the_same_logits(tmp_path, scan):
  cfg = tiny_config(scan_layers=scan)
  lora = LoraConfig(rank=4, alpha=8.0, target_modules=TARGETS)
  model = apply_lora(random_model(cfg), lora)
  adapter, _ = split_adapter(nnx.state(model))
  rng = np.random.default_rng(0)
  adapter = jax.tree.map(
    lambda x: jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype), adapter
  )
  nnx.update(model, adapter)
  tokens = jnp.asarray([[1, 5, 9, 33, 70, 2, 101, 7]])
  ours = np.asarray(forward(model, tokens))
  base = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(base)
  nnx.replace_by_pure_dict(
    state, plain_pure(nnx.to_pure_dict(nnx.state(model)))
  )
  save_hf(nnx.merge(graphdef, state), tmp_path / 'base')
  save_peft(adapter, lora, str(tmp_path / 'adapter'), base_model='base')
  hf = transformers.AutoModelForCausalLM.from_pretrained(
    tmp_path / 'base', torch_dtype=torch.float32
  )
  with torch.no_grad():
    plain = hf(torch.tensor(np.asarray(tokens))).logits.numpy()
    wrapped = peft.PeftModel.from_pretrained(hf, str(tmp_path / 'adapter'))
    theirs = wrapped(torch.tensor(np.asarray(tokens))).logits.numpy()
  assert np.abs(plain - ours).max() > 1e-2  # the adapter matters
  np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
  'family, targets',
  [
    ('qwen3_moe', 'q_proj,v_proj,gate_proj,up_proj,down_proj'),
    ('mixtral', 'o_proj,gate_proj,up_proj,down_proj'),
  ],
)
def test_moe_expert_adapters_load_in_peft_with_the_same_logits(
  tmp_path, family, targets
):
  """Per-expert PEFT keys (mlp.experts.<e>.gate_proj / Mixtral's
  block_sparse_moe.experts.<e>.w1) load onto transformers' fused experts
  through PEFT's conversion with jaxcorr's logits."""
  from tests.model.test_moe_hf_parity import FAMILIES, hf_moe

  if family == 'qwen3_moe':  # every layer MoE (dense ones: peft_refusal)
    FAMILIES[family][2]['mlp_only_layers'] = []
  try:
    ref = hf_moe(family)
  finally:
    FAMILIES['qwen3_moe'][2]['mlp_only_layers'] = [0]
  ref.save_pretrained(tmp_path / 'base')
  lora = LoraConfig(rank=2, alpha=4.0, target_modules=targets)
  model = apply_lora(load_hf(tmp_path / 'base'), lora)
  assert model.config.moe_layers == (0, 1, 2)
  adapter, _ = split_adapter(nnx.state(model))
  rng = np.random.default_rng(0)
  adapter = jax.tree.map(
    lambda x: jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype), adapter
  )
  nnx.update(model, adapter)
  tokens = np.random.default_rng(1).integers(0, 96, (2, 12))
  ours = np.asarray(forward(model, jnp.asarray(tokens)))
  out = tmp_path / 'adapter'
  save_peft(adapter, lora, str(out), base_model='base', model=model.config)
  keys = load_file(out / 'adapter_model.safetensors')
  expert = (
    'block_sparse_moe.experts.3.w1'
    if family == 'mixtral'
    else ('mlp.experts.7.gate_proj')
  )
  assert keys[
    f'base_model.model.model.layers.2.{expert}.lora_A.weight'
  ].shape == (2, 32)
  with torch.no_grad():
    plain = ref(torch.as_tensor(tokens)).logits.numpy()
    wrapped = peft.PeftModel.from_pretrained(ref, str(out)).eval()
    theirs = wrapped(torch.as_tensor(tokens)).logits.numpy()
  assert np.abs(plain - ours).max() > 1e-1  # the adapters matter
  np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)


def test_moe_adapters_peft_cannot_load_are_refused(tmp_path):
  """PEFT 0.21 drops dense-MLP adapters beside converted experts and
  cannot split a fused gate/up: `save_peft` says so instead of writing a
  directory that loads wrong (docs/lora.md)."""
  moe = TransformerConfig(
    architecture='Qwen3MoeForCausalLM',
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    moe_intermediate_size=8,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    num_experts=4,
    num_experts_per_tok=2,
  )
  mlp = LoraConfig(rank=2, target_modules='gate_proj,up_proj,down_proj')
  assert peft_refusal(mlp, moe) is None
  assert peft_refusal(mlp, moe.replace(mlp_only_layers=(0,))) is not None
  shared = moe.replace(
    architecture='Qwen2MoeForCausalLM', shared_expert_intermediate_size=8
  )
  assert 'shared expert' in peft_refusal(mlp, shared)
  attn = LoraConfig(rank=2, target_modules='q_proj,v_proj')
  assert peft_refusal(attn, shared) is None
  with pytest.raises(
    ValueError, match=r'target_modules=gate_proj,down_proj.*up_proj'
  ):
    save_peft(
      {},
      LoraConfig(rank=2, target_modules='gate_proj,down_proj'),
      str(tmp_path / 'x'),
      model=moe,
    )
  assert not (tmp_path / 'x').exists()
  node = {'lora_a': np.ones((4, 16, 2)), 'lora_b': np.ones((4, 2, 8))}
  pure = {'layers': {1: {'mlp': {'up_proj': {'lora': node}}}}}
  with pytest.raises(ValueError, match='MoE model config'):
    peft_tensors(pure)
  keys = peft_tensors(pure, moe)
  assert len(keys) == 8
  up = 'base_model.model.model.layers.1.mlp.experts.3.up_proj'
  assert keys[f'{up}.lora_B.weight'].shape == (8, 2)
  mixtral = moe.replace(architecture='MixtralForCausalLM', intermediate_size=8)
  assert target_modules(mlp, mixtral) == ['w1', 'w3', 'w2']
  assert target_modules(mlp, None) == ['gate_proj', 'up_proj', 'down_proj']
