"""GRPO on a real chat model and a reasoning-gym task: SmolLM2-135M-Instruct
on `chain_sum` (two 1-digit terms, + and -), scored by the task's own
`score_answer`; pass@1 and pass@8 before and after RL.

  make smollm2      # fetch and convert the model (once)
  pip install "jaxcorr[reasoning_gym]"
  python -m jaxcorr.main --config=configs/smollm2_rg.py \\
    --workdir=workdir/smollm2_rg --config.train.seed=0
  python -m jaxcorr.main --config=configs/smollm2_rg.py:pulse+disabled ...

The prompts are reasoning-gym's `chain_sum` questions ('State the final
answer to the following arithmetic problem: 4 - 1 =') in SmolLM2's own chat
template. The reward is the task's `score_answer` of the text in the
reply's last `<answer>...</answer>` (docs/data_and_rewards.md). Told in
words to use the tags, SmolLM2-135M never did (0 of 128 sampled replies in
a probe); so the prompt shows the format instead: two demonstration turns
(a question of the task and the reply `<answer>8</answer>`) before the
real question. Answers are a few tokens, so `max_new_tokens` stays small
and a 16-step run takes minutes on CPU.

Evaluation (docs/evaluation.md): at step 0 and step 16, on 64 held-out
questions (drawn with `data.seed + data.num_examples`), greedy accuracy and
8 sampled replies per question at the `standard` preset (pass@1, pass@8,
maj@8); every reply goes to `<workdir>/eval_samples/step_<N>.jsonl`.

Model, dtypes and engine as in configs/smollm2_arith.py (float32 trainer,
bfloat16 engine). The config string is `[pulse+]<preset>`, as there.
"""

from __future__ import annotations

import json

import ml_collections

from configs import base, smollm2_arith
from configs.arith_tiny import split
from jaxcorr.data.chat import chat_prompt_template
from jaxcorr.model import smollm2

TASK = 'chain_sum'
TASK_CONFIG = {'min_terms': 2, 'max_terms': 2, 'min_digits': 1, 'max_digits': 1}
SYSTEM = 'Reply with only the final answer inside <answer></answer> tags.'
# Demonstrations in the task's own wording, numbers not drawn from it.
EXAMPLES = (
  (
    'State the final answer to the following arithmetic problem: 3 + 5 =',
    '<answer>8</answer>',
  ),
  (
    'State the final answer to the following arithmetic problem: 2 - 6 =',
    '<answer>-4</answer>',
  ),
)


def prompt_template(model_dir: str) -> str:
  smollm2_arith.prompt_template(model_dir)  # the error for a missing model
  return chat_prompt_template(model_dir, system=SYSTEM, examples=EXAMPLES)


def apply_task(
  config: ml_collections.ConfigDict, model_dir: str | None = None
) -> None:
  """The task's values on top of configs/smollm2_arith.py's model and RL
  settings; `model_dir` defaults to where `make smollm2` writes."""
  model_dir = model_dir or smollm2.default_dir()
  smollm2_arith.apply_task(config, model_dir)
  config.data.source = 'reasoning_gym'
  config.data.task = TASK
  config.data.task_config = json.dumps(TASK_CONFIG)
  config.data.eval_examples = 64
  config.data.prompt_template = prompt_template(model_dir)
  config.rollout.max_prompt_length = 128
  config.rollout.max_new_tokens = 16
  config.reward.functions = 'reasoning_gym'
  config.train.eval_every = 16
  config.train.eval_prompts = 64
  config.eval.samples = 8
  config.eval.k = '1,8'
  config.eval.preset = 'standard'
  config.eval.samples_jsonl = True


def apply_pulse(config: ml_collections.ConfigDict) -> None:
  """A few small steps (the slow test and smoke runs)."""
  smollm2_arith.apply_pulse(config)
  config.eval.samples = 2
  config.eval.k = '1,2'


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  pulse, preset = split(config_string)

  def task(config: ml_collections.ConfigDict) -> None:
    apply_task(config)
    if pulse:
      apply_pulse(config)

  return base.get_config(preset, task=task)
