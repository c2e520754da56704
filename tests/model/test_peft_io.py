"""A LoRA policy written as a PEFT directory (jaxcorr/model/peft_io.py)
loads with `peft.PeftModel.from_pretrained` onto the transformers base
(written by `save_hf`) with the same logits as jaxcorr's, in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcorr.model import Transformer, save_hf
from jaxcorr.model.lora import (
  TARGETS,
  LoraConfig,
  apply_lora,
  plain_pure,
  split_adapter,
)
from jaxcorr.model.peft_io import save_peft
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
