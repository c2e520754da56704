"""An 8B Llama-3 policy with FSDP on a TPU v5p-64 (32 chips, 8 hosts).

Memory: 8B params x 16 bytes (float32 master weights, gradients and the
two AdamW moments) = 128 GB, plus a frozen bfloat16 reference (16 GB) for
the ref-KL, over 32 chips of 95 GB: about 4.5 GB per chip for the
training state with `fsdp=32`, leaving room for activations with
`remat='dots'`. Rollouts run colocated in bfloat16 (sync mode); for async
training give the engine its own chips with
`--config.rollout.mode=async --config.rollout.rollout_devices=8
--config.rollout.max_staleness=1` (the trainer then shards over the other
24). Launch on every host of the slice with `launch_tpu.sh` (docs/tpu.md)::

  ./launch_tpu.sh --project=P --zone=us-east5-a --accelerator-type=v5p-64 \\
    --tpu-name=jaxcorr-8b --config=configs/llama8b_fsdp.py:decoupled_geo_rs \\
    --workdir=gs://bucket/llama8b \\
    --extra-args='--config.model.hf_path=/models/Llama-3.1-8B-Instruct'

Untested on real hardware here (no TPU on the development machine); the
sharding rules are the ones `tests/test_sharding.py` checks on fake
devices.
"""

from __future__ import annotations

import ml_collections

from configs import base, gsm8k_qwen


def apply_task(config: ml_collections.ConfigDict) -> None:
  gsm8k_qwen.apply_task(config)
  config.model.hf_path = '/models/Llama-3.1-8B-Instruct'
  config.data.prompt_template = (
    '<|start_header_id|>user<|end_header_id|>\n\n{prompt} Give the final '
    'answer after "####".<|eot_id|><|start_header_id|>assistant'
    '<|end_header_id|>\n\n'
  )
  config.rollout.prompts_per_step = 128
  config.rollout.samples_per_prompt = 8
  config.rollout.max_new_tokens = 1024
  # The engine's KV cache is replicated over its devices (docs/rollout.md):
  # 128 slots x 1280 tokens x 128 KiB/token (bf16) = 21 GB per chip.
  config.rollout.max_concurrent_decodes = 128
  config.train.mini_batches = 8
  config.train.micro_batches = 4
  config.mesh.data = 1
  config.mesh.fsdp = -1
  config.mesh.tensor = 1


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  return base.get_config(config_string, task=apply_task)
