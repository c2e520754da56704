"""A LoRA run end to end (slow): the pulse trainer with adapters trains,
syncs adapters to the engine with the delivery check on every publish,
resumes exactly from its adapter-only checkpoint, and exports both as PEFT
(`--adapter`) and merged through the HF path, with the same logits."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jaxcorr import export
from jaxcorr.train.loop import Trainer
from tests.helpers.trainer_config import pulse_config

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')
peft = pytest.importorskip('peft')


def _config(steps: int):
  return pulse_config(
    length_reward=True,
    train__sft_steps=0,
    train__num_steps=steps,
    train__checkpoint_every=2,
    train__eval_every=0,
    optim__learning_rate=1e-2,
    lora__rank=4,
    lora__target_modules='q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj',
  )


@pytest.mark.slow
def test_lora_run_resumes_exactly_and_exports(tmp_path):
  whole = Trainer.from_config(_config(4), str(tmp_path / 'whole'))
  whole.train()
  assert whole.engine.weights.last_gap is not None  # checked every sync
  want = jax.device_get(whole.state.params)
  tokens = np.asarray([[1, 5, 9, 3, 7, 2]])
  policy = nnx.merge(whole.graphdef, whole.state.policy_params())
  ours = np.asarray(jax.jit(lambda t: policy(t))(tokens))
  whole.close()
  part = Trainer.from_config(_config(2), str(tmp_path / 'resumed'))
  part.train()
  part.close()
  resumed = Trainer.from_config(
    _config(4), str(tmp_path / 'resumed'), allow_config_change=True
  )
  resumed.train()
  for a, b in zip(
    jax.tree.leaves(want), jax.tree.leaves(jax.device_get(resumed.state.params))
  ):
    np.testing.assert_array_equal(a, b)
  resumed.close()
  run = str(tmp_path / 'whole')
  export.export(run, str(tmp_path / 'merged'))
  export.export(run, str(tmp_path / 'adapter'), adapter=True)
  merged = transformers.AutoModelForCausalLM.from_pretrained(
    tmp_path / 'merged', torch_dtype=torch.float32
  )
  assert (tmp_path / 'adapter' / 'adapter_model.safetensors').is_file()
  with torch.no_grad():
    got = merged(torch.tensor(tokens)).logits.numpy()
  # The merged export is the policy the trainer held.
  np.testing.assert_allclose(got, ours, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_lora_moe_pulse_run_trains_syncs_and_exports(tmp_path):
  """configs/arith_moe.py's pulse (Mixtral, bf16 engine, R3) with adapters
  on attention and every expert: trains, syncs adapters with the delivery
  check, exports per-expert PEFT keys and the merged model."""
  from configs import arith_moe

  c = arith_moe.get_config('pulse')
  c.train.sft_steps = 0
  c.train.num_steps = 2
  c.train.eval_every = 0
  c.optim.learning_rate = 1e-2
  # A scratch policy scores 0 on every row, so GRPO's advantages are 0: the
  # entropy bonus gives every routed expert a gradient whatever the reward.
  c.actor.entropy_coeff = 0.1
  c.lora.rank = 4
  c.lora.target_modules = 'q_proj,v_proj,gate_proj,up_proj,down_proj'
  trainer = Trainer.from_config(c, str(tmp_path / 'run'))
  before = jax.device_get(trainer.state.params)
  trainer.train()
  assert trainer.engine.weights.last_gap is not None  # checked every sync
  after = jax.device_get(trainer.state.params)
  trainer.close()
  b0, b1 = (
    np.asarray(
      nnx.to_pure_dict(t)['layers'][1]['mlp']['up_proj']['lora']['lora_b']
    )
    for t in (before, after)
  )
  assert b0.shape[0] == 8 and np.any(b0 != b1)  # [E, r, F]: experts learn
  run = str(tmp_path / 'run')
  export.export(run, str(tmp_path / 'adapter'), adapter=True)
  keys = load_file(tmp_path / 'adapter' / 'adapter_model.safetensors')
  name = 'base_model.model.model.layers.1.block_sparse_moe.experts.7.w3'
  assert keys[f'{name}.lora_B.weight'].shape == (32, 4)
  export.export(run, str(tmp_path / 'merged'))
  merged = transformers.AutoModelForCausalLM.from_pretrained(
    tmp_path / 'merged', torch_dtype=torch.float32
  )
  assert type(merged).__name__ == 'MixtralForCausalLM'
