"""GRPO on GSM8K with Qwen2.5-0.5B/1.5B-Instruct, sized for a TPU v5e-8.

Nothing is downloaded: point the config at a local HF checkpoint directory
and a GSM8K JSONL file (the `question` / `answer` layout of
`openai/gsm8k`, whose answers end in `#### <number>`)::

  python -m jaxcorr.main --workdir=gs://bucket/gsm8k \\
    --config=configs/gsm8k_qwen.py:decoupled_geo_rs \\
    --config.model.hf_path=/models/Qwen2.5-0.5B-Instruct \\
    --config.data.path=/data/gsm8k/train.jsonl \\
    --config.data.eval_path=/data/gsm8k/test.jsonl

The config string is a correction preset (`configs/presets.py`, default
`disabled`). Sizing (v5e-8, 16 GB HBM per chip): 0.5B or 1.5B params in
bfloat16 compute with float32 master weights and AdamW = 16 bytes/param,
i.e. 8 or 24 GB in all, sharded over `fsdp=8`; 64 prompts x 8 samples with
up to 512 new tokens per step, 4 mini-batches (4 updates per step) of 4
micro-batches each. The rollout engine runs in bfloat16 on the same chips
(sync mode), so the bf16-engine / fp32-trainer mismatch is exactly what the
correction presets are for.
"""

from __future__ import annotations

import ml_collections

from configs import base

PROMPT = (
  '<|im_start|>system\nPlease reason step by step, and put your final '
  'answer after "####".<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n'
  '<|im_start|>assistant\n'
)


def apply_task(config: ml_collections.ConfigDict) -> None:
  config.model.hf_path = '/models/Qwen2.5-0.5B-Instruct'
  config.model.dtype = 'bfloat16'
  config.model.param_dtype = 'float32'
  config.model.remat = 'dots'
  config.model.scan_layers = True
  config.model.logprob_chunk = 256
  config.data.source = 'jsonl'
  config.data.path = '/data/gsm8k/train.jsonl'
  config.data.eval_path = '/data/gsm8k/test.jsonl'
  config.data.prompt_field = 'question'
  config.data.answer_field = 'answer'
  config.data.answer_format = 'gsm8k'
  config.data.prompt_template = PROMPT
  config.rollout.prompts_per_step = 64
  config.rollout.samples_per_prompt = 8
  config.rollout.max_prompt_length = 256
  config.rollout.max_new_tokens = 512
  # GSM8K answers run from ~100 to 512 tokens and the prompts from ~60 to
  # 256: packed rows skip the padding (at SmolLM2's shape, 512 new tokens,
  # 58% real, the update is 1.26x faster packed on an H200;
  # docs/benchmarks.md, "GPU: one NVIDIA H200, second run").
  config.train.packing = True
  config.rollout.temperature = 1.0
  config.rollout.max_concurrent_decodes = 256
  config.rollout.engine_dtype = 'bfloat16'
  config.reward.functions = 'math_answer:1.0,format:0.1'
  config.reward.timeout_s = 5.0
  config.train.num_steps = 500
  config.train.sft_steps = 0
  config.train.ppo_epochs = 1
  config.train.mini_batches = 4
  config.train.micro_batches = 4
  config.train.checkpoint_every = 50
  config.train.eval_every = 25
  config.train.eval_prompts = 256
  config.optim.learning_rate = 1e-6
  config.optim.warmup_steps = 10
  config.optim.schedule = 'constant'
  config.optim.weight_decay = 0.01
  config.optim.max_grad_norm = 1.0
  config.algorithm.estimator = 'grpo'
  config.actor.kl_loss_coef = 0.001
  config.actor.kl_loss_type = 'low_var_kl'
  config.mesh.data = 1
  config.mesh.fsdp = -1
  config.mesh.tensor = 1


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  return base.get_config(config_string, task=apply_task)
