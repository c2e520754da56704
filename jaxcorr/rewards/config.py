"""The trainer's `reward` section (docs/data_and_rewards.md).

One frozen dataclass of `setting`s; the trainer builds its `RewardScorer`
from it. Whether every named function is registered is checked once at
start-up by `jaxcorr.train.build` (`jaxcorr.rewards.check_spec`), not here:
reward functions are registered by user code the config file imports.
"""

from __future__ import annotations

import dataclasses

from jaxcorr.config.fields import (
  boolean,
  integer,
  number,
  one_of,
  setting,
  text,
  validate,
)
from jaxcorr.losses.overlong import PENALTY_AT, check_overlong


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """Reward functions of `jaxcorr.rewards`, by name, and their time limits;
  the overlong shaping of the scores (jaxcorr/losses/overlong.py)."""

  functions: str = setting(
    'exact_match',
    text,
    "'name:weight,name:weight' (weight 1 when omitted): exact_match, "
    'math_answer, format, arith_exact, or any registered name.',
  )
  timeout_s: float = setting(
    5.0,
    number(0),
    'Seconds per call; a call that takes longer scores 0 (metric '
    'reward/timeouts). 0: no per-call limit (the step budget still '
    'applies).',
  )
  step_budget_s: float = setting(
    300.0,
    number(0),
    'Seconds all reward calls of one step may take; calls unfinished then '
    'score 0 (reward/timeouts, reward/budget_exceeded). 0: no budget.',
  )
  isolation: str = setting(
    'thread',
    one_of('thread', 'process'),
    "Where calls run: 'thread' (worker threads; cheap, but a call that "
    "holds the GIL freezes the trainer, SIGTERM included) or 'process' "
    '(worker processes killed and replaced on timeout; rewards must be '
    'registered at import of their module). docs/data_and_rewards.md.',
  )
  max_failure_fraction: float = setting(
    0.9,
    number(0, 1),
    'A function that fails (raises, returns a non-number) on more than this '
    'fraction of its rows in 3 scored batches in a row stops the run, naming '
    'it and its first failure. 1: never stop (failures score 0).',
  )

  mask_truncated_completions: bool = setting(
    False,
    boolean,
    "TRL's mask_truncated_completions: a truncated row (finish LENGTH: "
    'max_new_tokens, or a multi-turn max_turns / token budget) carries no '
    'loss; it still counts in its group baseline.',
  )
  overlong_buffer_enable: bool = setting(
    False,
    boolean,
    "DAPO's soft overlong penalty (verl reward_model.overlong_buffer."
    'enable; NeMo-RL grpo.reward_shaping.enabled).',
  )
  overlong_buffer_len: int = setting(
    0,
    integer(0),
    'DAPO cache length L_buf (verl overlong_buffer.len, NeMo-RL '
    'overlong_buffer_length): the penalty ramps over the last L_buf tokens '
    'of rollout.max_new_tokens; >= 1 and <= max_new_tokens when enabled.',
  )
  overlong_penalty_factor: float = setting(
    1.0,
    number(0),
    'Penalty at the full length (verl overlong_buffer.penalty_factor, '
    'NeMo-RL overlong_buffer_penalty); >= 0.',
  )
  overlong_penalty_at: str = setting(
    'reward',
    one_of(*PENALTY_AT),
    "'reward': added to the score before the advantage estimator (DAPO); "
    "'loss': added to the advantage after it (not normalised by the group).",
  )

  def __post_init__(self):
    check_overlong(self, validate(self))
