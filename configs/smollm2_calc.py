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

No SFT warm-up: the trainer's SFT is single-turn (prompt -> answer), and a
multi-turn demonstration warm-up is not implemented; the base model's
tool-call rate is what RL starts from (`agent/tool_call_rate`).

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
  config.rollout.max_prompt_length = 256  # system message with the schema
  config.rollout.max_new_tokens = 192  # every turn after the prompt
  config.rollout.decode_chunk = 32
  config.agent.environment = 'calculator'
  config.agent.chat_template = 'model'
  config.agent.user_content = 'What is {prompt}'
  config.agent.system_prompt = True
  config.agent.max_turns = 3
  config.agent.turn_tokens = 64
  config.agent.max_env_tokens = 32


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  pulse, preset = split(config_string)

  def task(config: ml_collections.ConfigDict) -> None:
    apply_task(config)
    if pulse:
      smollm2_arith.apply_pulse(config)

  return base.get_config(preset, task=task)
