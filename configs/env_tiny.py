"""A custom environment on the embedded tiny model, no downloads: the
environment is written and registered here, in the config module, and the
run is the usual command:

  python -m jaxcorr.main --config=configs/env_tiny.py --workdir=/tmp/guess
  python -m jaxcorr.main --config=configs/env_tiny.py:pulse ...

'guess_tiny' (the environment of docs/agents.md, "Writing an environment"): the
row is an addition of the arithmetic task ('3+4='), the agent answers a
number, and the environment replies 'higher' or 'lower' until the answer is
right or `agent.max_turns` turns are spent. The reward is the exact match
of the last answer. Its replies are words, which the 27-id character
vocabulary cannot encode, so the model reads bytes (`data.tokenizer=
'bytes'`, `jaxcorr.data.text.ByteTokenizer`); the turns use the 'arith'
chat template ('Q: 3+4=?\\nA: 9\\n= lower\\nA: 7').

The SFT warm-up plays the environment's expert, a binary search over the
answers' range (0-18) that reads the replies, so the warm-up trains the
turn format and acting on a reply; RL then rewards the trajectories whose
last answer is the sum. What the full run reaches is not measured: the
config shows a custom environment running end to end on a laptop.
`pulse` (2 SFT steps) checks that every stage runs.

Registering in a config module: `jaxcorr.main` loads this file as a module
of its own and a test may import `configs.env_tiny` as well, so the
environment is registered once, by the first (`register_once`).
`jaxcorr.evaluate` runs the run's config file first, so a saved run
evaluates with the environment registered. The config string is
`[pulse+]<preset>` as in configs/arith_tiny.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ml_collections

from configs import arith_tiny
from jaxcorr.agents.environment import (
  ENVIRONMENTS,
  EnvironmentSpec,
  StepResult,
  register_environment,
)
from jaxcorr.agents.tool_calls import ToolCallFormat
from jaxcorr.data.tasks import Example
from jaxcorr.data.text import ByteTokenizer

# Not docs/agents.md's 'guess': both register in one test process.
NAME = 'guess_tiny'
MAX_OPERAND = 9  # answers 0..18: the expert needs at most 5 guesses
MAX_TURNS = 5


class Guess:
  """One trajectory: answer the row's sum; 'higher' / 'lower' otherwise."""

  def reset(self, row: Example) -> list[dict[str, Any]]:
    self.target = int(row.answer)
    return [{'role': 'user', 'content': row.prompt}]

  def step(self, action: str) -> StepResult:
    text = action.strip()
    guess = int(text) if text.lstrip('-').isdigit() else None
    if guess == self.target:
      return StepResult([], done=True)
    if guess is None:
      hint = 'a number'
    else:
      hint = 'higher' if guess < self.target else 'lower'
    return StepResult([{'role': 'tool', 'content': hint}])


def binary_search(row: Example, messages: Sequence[dict[str, Any]]) -> str:
  """The expert: the middle of what the replies so far leave open."""
  lo, hi = 0, 2 * MAX_OPERAND
  last = None
  for m in messages:
    if m['role'] == 'assistant':
      last = int(m['content'])
    elif m['role'] == 'tool' and last is not None:
      lo, hi = (last + 1, hi) if m['content'] == 'higher' else (lo, last - 1)
  return str((lo + hi) // 2)


def guess_environment(cfg: Any) -> EnvironmentSpec:
  """No tools: the agent's whole turn is its guess."""
  return EnvironmentSpec(
    tools=(),
    call_format=ToolCallFormat(),
    make=lambda session: Guess(),
    expert=binary_search,
  )


def register_once() -> None:
  if NAME not in ENVIRONMENTS:
    register_environment(NAME)(guess_environment)


register_once()


def apply_task(config: ml_collections.ConfigDict) -> None:
  """configs/arith_tiny.py's model and RL settings, over bytes, in 'guess_tiny'."""
  arith_tiny.apply_task(config)
  config.model.vocab_size = ByteTokenizer.vocab_size
  config.model.max_position_embeddings = 128
  config.data.tokenizer = 'bytes'
  config.data.max_operand = MAX_OPERAND
  config.rollout.max_prompt_length = 16  # BOS + 'Q: 9+9=?\nA: '
  config.rollout.max_new_tokens = 96  # every turn after the prompt
  config.rollout.decode_chunk = 16
  config.agent.environment = NAME
  config.agent.chat_template = 'arith'
  config.agent.system_prompt = False
  config.agent.max_turns = MAX_TURNS
  config.agent.turn_tokens = 4  # '18' and the turn's end
  config.agent.max_env_tokens = 16  # '= higher\nA: ' and the like


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  return arith_tiny.task_config(config_string, apply_task)
