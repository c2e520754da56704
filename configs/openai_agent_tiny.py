"""An agent written against the OpenAI API, trained on the embedded tiny
model over bytes, no downloads:

  python -m jaxcorr.main --config=configs/openai_agent_tiny.py --workdir=/tmp/oa
  python -m jaxcorr.main --config=configs/openai_agent_tiny.py:pulse ...

The agent (`guess_agent`) is an ordinary `openai` client program: it asks
the row's sum ('3+4='), reads the reply, and answers 'higher' or 'lower'
in a tool message until the reply is right or it has asked `ROUNDS` times.
It never sees the trainer: its client's base_url is the endpoint
(jaxcorr/endpoint), whose session records the sampled ids, μ and policy
versions of every reply; the trainer scores the last reply against the
row's answer (exact match) and trains with correction as for any
environment. The turns use the 'arith' chat template over bytes, as in
configs/env_tiny.py. No SFT warm-up (the agent has no expert): what RL
reaches from a random model is not measured; `pulse` checks that every
stage runs. The config string is `[pulse+]<preset>` as in
configs/arith_tiny.py.
"""

from __future__ import annotations

import ml_collections

from configs import arith_tiny, env_tiny
from jaxcorr.endpoint import AgentCall, register_agent

NAME = 'openai_guess'
ROUNDS = 3


def guess_agent(call: AgentCall) -> None:
  """Ask the sum; say higher or lower until right or `ROUNDS` replies."""
  client = call.client()  # openai's 10-minute time-out: a reply may wait
  messages = [{'role': 'user', 'content': call.row.prompt}]
  for _ in range(ROUNDS):
    reply = client.chat.completions.create(model=call.model, messages=messages)
    text = reply.choices[0].message.content or ''
    messages.append({'role': 'assistant', 'content': text})
    text = text.strip()
    if reply.choices[0].finish_reason == 'length' or text == call.row.answer:
      return None
    hint = 'higher'
    if text.lstrip('-').isdigit() and int(text) > int(call.row.answer):
      hint = 'lower'
    messages.append({'role': 'tool', 'content': hint})
  return None


register_agent(NAME, guess_agent)


def apply_task(config: ml_collections.ConfigDict) -> None:
  """configs/env_tiny.py's model, data and budgets, with the agent."""
  env_tiny.apply_task(config)
  config.agent.environment = NAME
  config.agent.max_turns = ROUNDS
  config.train.sft_steps = 0


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  return arith_tiny.task_config(config_string, apply_task, sft_steps=0)
