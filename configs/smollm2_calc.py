"""Multi-turn tool use on a real chat model: SmolLM2-135M-Instruct with a
calculator on 3-digit multiplication, which it gets wrong on its own.

  make smollm2      # fetch and convert the model (once)
  python -m jaxcorr.main --config=configs/smollm2_calc.py \\
    --workdir=workdir/smollm2_calc
  python -m jaxcorr.main --config=configs/smollm2_calc.py:pulse+decoupled_geo_rs ...

The 'calculator' environment (jaxcorr/agents/environment.py) opens with a
system message listing the tool's JSON schema and the Hermes call format,
then the user turn 'What is 123*456?'. The model may answer directly or
call `<tool_call>{"name": "calculator", "arguments": {"expression":
"123*456"}}</tool_call>` (a safe evaluator, no `eval`), read the result in
a `tool` message (SmolLM2's ChatML template renders the delta), and
answer; `math_answer` scores the last number of the final turn. Tool
results and template tokens are context, never a loss term; the engine
runs in bfloat16 and the trainer in float32, so the correction sees the
mismatch on agent tokens only (docs/agents.md).

The base model never calls the tool (docs/agents.md), so RL would have
no tool-using trajectory to reinforce: a short SFT warm-up first,
`train.sft_steps=6` steps of 8 demonstrations (48 in all, learning rate
2e-5, 2 of the steps warming up) of the calculator expert
(jaxcorr/agents/demonstrations.py: the Hermes call, the tool's result, the
answer), played through the real environment in SmolLM2's template, the
loss on the agent's tokens only. The length was measured, not guessed:
after 4 steps the greedy policy never calls the tool (and neither did 64
sampled trajectories), after 8 or 16 steps it always does and is right on
every held-out problem, leaving RL nothing to learn; after 6 it calls the
tool on 36% of them. RL (12 steps) then has groups that differ. The
evaluation at step 0 (after the warm-up) and step 12 is greedy with the
tool on 64 held-out problems (`eval/accuracy`, `eval/tool_call_rate`,
`eval/turns_mean`); bench/smollm2_calc.py measures a checkpoint with and
without the tool.

The config string is `[pulse+]<preset>`, as in configs/smollm2_arith.py.
"""

from __future__ import annotations

import ml_collections

from configs import base, smollm2_arith
from configs.arith_tiny import split
from jaxcorr.model import smollm2


def apply_task(
  config: ml_collections.ConfigDict, model_dir: str | None = None
) -> None:
  """SmolLM2 (as configs/smollm2_arith.py) in the calculator environment."""
  model_dir = model_dir or smollm2.default_dir()
  smollm2_arith.apply_task(config, model_dir)
  config.data.max_operand = 999
  config.data.ops = '*'
  config.data.prompt_template = smollm2_arith.prompt_template(model_dir)
  config.rollout.max_prompt_length = 192  # the schema system message: <= 189
  config.rollout.max_new_tokens = 96  # every turn after the prompt
  config.rollout.decode_chunk = 32
  config.agent.environment = 'calculator'
  config.agent.chat_template = 'model'
  config.agent.user_content = 'What is {prompt}'
  config.agent.system_prompt = True
  config.agent.max_turns = 3
  config.agent.turn_tokens = 48
  config.agent.max_env_tokens = 32
  config.data.eval_examples = 64
  config.train.eval_prompts = 64
  config.train.sft_steps = 6
  config.train.num_steps = 12
  config.train.eval_every = 12
  config.train.sft_batch_size = 8
  # Trajectories fill up to 288 positions: 4 micro-batches of 8 rows keep
  # the float32 update's activations near configs/smollm2_rg.py's (~15 GB).
  config.train.micro_batches = 4
  config.optim.sft_learning_rate = 2e-5


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  pulse, preset = split(config_string)

  def task(config: ml_collections.ConfigDict) -> None:
    apply_task(config)
    if pulse:
      smollm2_arith.apply_pulse(config)
      config.train.sft_steps = 2
      config.train.sft_batch_size = 4

  return base.get_config(preset, task=task)
