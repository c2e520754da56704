"""A trajectory: one sequence per episode, token-in / token-out, with an
agent mask, and the `RolloutBatch` of a batch of them.

    prompt            the opening messages' ids (the row's prompt side)
    tokens            everything after it, in order: each agent turn's ids
                      exactly as the engine sampled them, each environment
                      turn's ids (the chat template's delta, `turns`)
    agent             True on the agent's tokens
    logp, logp_t      μ of each agent token (0.0 on environment tokens)
    versions          the policy version that sampled each agent token
                      (-1 on environment tokens)
    turn_spans        [start, end) of each agent turn in `tokens`; the
                      environment turn after agent turn k is
                      tokens[turn_spans[k][1]:turn_spans[k + 1][0]]

In the `RolloutBatch` (docs/math/rollout_contract.md §4-§5) the prompt is
the prompt side, the tokens the response side: `context_mask` covers every
real token, `response_mask` the agent's only, so environment and template
tokens are context the trainer's forward attends to but never a loss
term, a μ or a version. A trajectory that hits the token budget or the
turn limit before its answer is `truncated` (FinishReason.LENGTH); with
`drop_truncated` its agent tokens leave `response_mask` too, so it trains
nothing (it still counts in its group's baseline). One whose environment
failed (`error`, jaxcorr/agents/failures.py) is an ABORT row: the update
drops it.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxcorr.rollout import FinishReason, RolloutBatch
from jaxcorr.rollout.driver import sequence_fields
from jaxcorr.rollout.state import SamplingParams


@dataclasses.dataclass
class Trajectory:
  """Host record of one episode (module docstring).

  Attributes:
    row, group, sample: its `RolloutBatch` row, group and sample ids.
    prompt: the prompt ids.
    turns: agent turns so far.
    turn_spans: [start, end) of each finished agent turn in `tokens`.
    turn_rewards: the environment's reward after each agent turn.
    truncated: ended by a budget, not by an answer.
    finish: its `FinishReason`.
    final_text: the last agent turn's decoded text (what is scored).
    info: the environment's counts, summed over turns.
    tool_outcomes: its tool calls per outcome (`ToolSession.counts`).
    error: the environment's failure that ended it ('' if none).
  """

  row: int
  group: int
  sample: int
  prompt: list[int]
  tokens: list[int] = dataclasses.field(default_factory=list)
  agent: list[bool] = dataclasses.field(default_factory=list)
  logp: list[float] = dataclasses.field(default_factory=list)
  logp_truncated: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  turns: int = 0
  turn_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
  turn_rewards: list[float] = dataclasses.field(default_factory=list)
  truncated: bool = False
  finish: FinishReason = FinishReason.STOP
  final_text: str = ''
  info: dict[str, float] = dataclasses.field(default_factory=dict)
  tool_outcomes: collections.Counter[str] = dataclasses.field(
    default_factory=collections.Counter
  )
  error: str = ''

  def add_agent(self, tokens, logp, logp_t, version: int) -> None:
    """Sampled tokens with their log-probs, under policy `version`."""
    tokens = np.asarray(tokens).tolist()
    self.tokens += tokens
    self.agent += [True] * len(tokens)
    self.logp += np.asarray(logp, np.float32).tolist()
    self.logp_truncated += np.asarray(logp_t, np.float32).tolist()
    self.versions += [int(version)] * len(tokens)

  def add_env(self, ids: Sequence[int]) -> None:
    """Environment / template tokens: context, never a loss term."""
    n = len(ids)
    self.tokens += [int(i) for i in ids]
    self.agent += [False] * n
    self.logp += [0.0] * n
    self.logp_truncated += [0.0] * n
    self.versions += [-1] * n

  def fail(self, error: str) -> None:
    """End as an ABORT row: its environment failed (`failures.describe`)."""
    self.error = self.error or error
    self.finish = FinishReason.ABORT
    self.info['env_errors'] = 1.0

  @property
  def length(self) -> int:
    """Prompt and response tokens."""
    return len(self.prompt) + len(self.tokens)

  @property
  def reward(self) -> float:
    """The sum of the turn rewards (the outcome reward is added by the
    trainer's reward functions)."""
    return float(sum(self.turn_rewards))


def to_batch(
  trajectories: Sequence[Trajectory],
  *,
  prompt_length: int,
  response_length: int,
  sp: SamplingParams,
  drop_truncated: bool = False,
  engine_name: str = 'jaxcorr.agents/PolicyEngine',
  param_dtype: str = '',
  kv_cache_dtype: str = '',
) -> RolloutBatch:
  """Trajectories (row i at position i) -> a host `RolloutBatch` of
  [B, prompt_length] prompts (left-padded) and [B, response_length]
  responses (module docstring)."""
  trained = [
    [a and not (drop_truncated and tr.truncated) for a in tr.agent]
    for tr in trajectories
  ]
  return RolloutBatch(
    **sequence_fields(
      trajectories, prompt_length, response_length, sp, trained
    ),
    engine_name=engine_name,
    param_dtype=param_dtype,
    kv_cache_dtype=kv_cache_dtype,
  )
