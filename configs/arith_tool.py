"""A tiny tool task from scratch: 2-digit multiplication with a calculator.

The arithmetic model of configs/arith_tiny.py (character vocabulary, no
downloads) acts in the 'calculator' environment (jaxcorr/agents/): the
prompt is 'Q: 17*25=?\\nA: '; the agent may call the calculator by writing
the expression between parentheses, '(17*25)', and gets '= 425' back in
the next turn ('= ?' for a malformed call or a failing expression), then
answers '425'. The reward is the exact match of the final turn. Tool
results and the template's turn markers are context, never a loss term
(docs/agents.md).

  python -m jaxcorr.main --config=configs/arith_tool.py --workdir=/tmp/tool
  python -m jaxcorr.main --config=configs/arith_tool.py:pulse ...

The config string is `[pulse+]<preset>` as in configs/arith_tiny.py.
The SFT warm-up (`train.sft_steps`, configs/arith_tiny.py's 300 steps)
trains on the calculator expert's demonstrations
(jaxcorr/agents/demonstrations.py): '(17*25)', the tool's '= 425', then
'425', played through the real environment, the loss on the agent's
tokens only. RL then starts from a model that calls the tool. `pulse`
(2 SFT steps) checks that every stage of a multi-turn step runs, not that
it learns.
"""

from __future__ import annotations

import ml_collections

from configs import arith_tiny


def apply_task(config: ml_collections.ConfigDict) -> None:
  """The arithmetic model with the calculator environment."""
  arith_tiny.apply_task(config)
  config.model.max_position_embeddings = 64
  config.data.ops = '*'
  config.rollout.max_prompt_length = 16  # BOS + 'Q: 99*99=?\nA: '
  config.rollout.max_new_tokens = 40  # all turns after the prompt
  config.rollout.decode_chunk = 16
  config.agent.environment = 'calculator'
  config.agent.chat_template = 'arith'
  config.agent.call_start = '('
  config.agent.call_end = ')'
  config.agent.call_body = 'text'
  config.agent.terse_errors = True
  config.agent.system_prompt = False
  config.agent.max_turns = 3
  config.agent.turn_tokens = 12
  config.agent.max_env_tokens = 15  # '\n= 9801\nA: ' and the like


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  return arith_tiny.task_config(config_string, apply_task)
