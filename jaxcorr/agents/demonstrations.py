"""Demonstrations: an environment's `Expert` played through the real
environment, as token sequences with an agent mask, for the SFT warm-up
(`train.sft_steps` with `config.agent.environment`; jaxcorr/train/sft.py).

A model that never calls a tool gives RL no tool-using trajectory to
reinforce (docs/agents.md: SmolLM2-135M answers at once, wrongly). The
warm-up teaches the call format on trajectories built exactly as RL builds
them, so nothing the model learns here is off by a token:

    ids = prompt_ids(env.reset(row))                 context
    repeat:
      action = expert(row, conversation)             None: done
      ids += encode(action) + [end]                  agent (loss)
      result = env.step(action)                      the real tool runs
      result.done: stop
      ids += env_ids(result.observation, end)        context

`end` is the token that closes an agent turn: the first token of the chat
template's text after an assistant message when that is a stop token
(SmolLM2's '<|im_end|>'), else EOS; a sampled turn ends with it too, and
`TurnFormat.env_ids` drops it from the delta the same way. The one
difference from a sampled trajectory is that the expert's text is encoded
here, where RL keeps the sampled ids; a tokenizer round-trips its own
encoding, so the ids are the ones the model would sample for that text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxcorr.agents.environment import EnvironmentSpec, Message
from jaxcorr.agents.failures import check_result
from jaxcorr.agents.tool_runner import ToolRunner, ToolSession
from jaxcorr.agents.turns import TurnFormat
from jaxcorr.data.tasks import Example


@dataclasses.dataclass(frozen=True)
class Demonstration:
  """One expert trajectory: prompt and response ids, which are the
  agent's, and how many turns it took."""

  prompt: list[int]
  tokens: list[int]  # the response: agent turns and observations
  agent: list[bool]  # per token of `tokens`: the agent wrote it
  turns: int


def turn_end_id(turns: TurnFormat, tokenizer: Any, stop_ids: Sequence[int]):
  """The id that closes an agent turn (module docstring)."""
  tail = list(tokenizer.encode(turns.tail, bos=False)) if turns.tail else []
  if tail and tail[0] in stop_ids:
    return tail[0]
  return tokenizer.eos_id


def demonstrate(
  spec: EnvironmentSpec,
  runner: ToolSession | ToolRunner,
  turns: TurnFormat,
  tokenizer: Any,
  end_id: int,
  row: Example,
  *,
  max_turns: int,
) -> Demonstration:
  """The expert's trajectory on `row` (module docstring); `runner` is
  what the environment is made with (`EnvironmentSpec.make`).

  Raises:
    ValueError: the environment has no expert, the expert is still
      acting after `max_turns` turns, or a step's result is unusable
      (`failures.BadResult`); and whatever the expert or the
      environment raises.
  """
  if spec.expert is None:
    raise ValueError('this environment has no expert to demonstrate with')
  env = spec.make(runner)
  conversation: list[Message] = list(env.reset(row))
  prompt = turns.prompt_ids(conversation)
  tokens: list[int] = []
  agent: list[bool] = []
  taken = 0
  while (action := spec.expert(row, conversation)) is not None:
    if taken == max_turns:
      raise ValueError(
        f'the expert takes more than config.agent.max_turns={max_turns} '
        f'turns on {row.prompt!r}'
      )
    taken += 1
    ids = [*tokenizer.encode(action, bos=False), end_id]
    tokens += ids
    agent += [True] * len(ids)
    conversation.append({'role': 'assistant', 'content': action})
    result = check_result(env.step(action), tokenizer.vocab_size)
    if result.done:
      break
    observation = result.observation
    if observation and isinstance(observation[0], dict):
      conversation += observation
      observation = turns.env_ids(observation, end_id)
    tokens += observation
    agent += [False] * len(observation)
  return Demonstration(prompt, tokens, agent, turns=taken)
