"""GRPO on SmolLM2-135M-Instruct and the sandboxed code task: generated
'write a Python function f(x) that returns ...' prompts in the model's
chat template, each reply's last ```python block run against five hidden
tests in the sandbox (`code_tests`: the fraction passed;
docs/data_and_rewards.md "Sandboxed code").

  make smollm2      # fetch and convert the model (once)
  python -m jaxcorr.main --config=configs/smollm2_code.py \\
    --workdir=workdir/smollm2_code
  python -m jaxcorr.main --config=configs/smollm2_code.py:pulse+disabled ...

Model, dtypes and engine as in configs/smollm2_arith.py; the reward's
outcomes per step (passed, failed_tests, no_code, error, timeout, ...) are
in reward/code_tests/outcome/<reason>. The config string is
`[pulse+]<preset>`, as there.
"""

from __future__ import annotations

import ml_collections

from configs import base, code_tiny, smollm2_arith
from configs.arith_tiny import split
from jaxcorr.data.chat import chat_prompt_template
from jaxcorr.model import smollm2

SYSTEM = 'You are a Python programmer. Reply with code only.'


def apply_task(
  config: ml_collections.ConfigDict, model_dir: str | None = None
) -> None:
  """The task's values on top of configs/smollm2_arith.py's model and RL
  settings; `model_dir` defaults to where `make smollm2` writes."""
  model_dir = model_dir or smollm2.default_dir()
  smollm2_arith.apply_task(config, model_dir)
  code_tiny.apply_sandbox_reward(config)
  smollm2_arith.prompt_template(model_dir)  # the error for a missing model
  config.data.prompt_template = chat_prompt_template(model_dir, system=SYSTEM)
  config.data.eval_examples = 64
  config.rollout.max_prompt_length = 96
  config.rollout.max_new_tokens = 96
  config.train.eval_every = 16
  config.train.eval_prompts = 64


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  pulse, preset = split(config_string)

  def task(config: ml_collections.ConfigDict) -> None:
    apply_task(config)
    if pulse:
      smollm2_arith.apply_pulse(config)

  return base.get_config(preset, task=task)
