"""The trainer's `reward` section (docs/data_and_rewards.md).

One frozen dataclass of `setting`s; the trainer builds its `RewardScorer`
from it. Whether every named function is registered is checked once at
start-up by `jaxcorr.train.build` (`jaxcorr.rewards.check_spec`), not here:
reward functions are registered by user code the config file imports.
"""

from __future__ import annotations

import dataclasses

from jaxcorr.config.fields import number, setting, text, validate


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """Reward functions of `jaxcorr.rewards`, by name, and their time limits."""

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

  def __post_init__(self):
    validate(self)
