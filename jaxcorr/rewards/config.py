"""The trainer's `reward` section (docs/data_and_rewards.md).

One frozen dataclass of `setting`s; the trainer builds its `RewardScorer`
from it. Whether every named function is registered is checked once at
start-up by `jaxcorr.train.build` (`jaxcorr.rewards.check_spec`), not here:
reward functions are registered by user code the config file imports.
"""

from __future__ import annotations

import dataclasses

from jaxcorr.config.fields import number, one_of, setting, text, validate
from jaxcorr.losses.overlong import OverlongKnobs, check_overlong


@dataclasses.dataclass(frozen=True)
class RewardConfig(OverlongKnobs):
  """Reward functions of `jaxcorr.rewards`, by name, and their time limits;
  the overlong shaping of the scores (`OverlongKnobs`,
  jaxcorr/losses/overlong.py)."""

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

  def __post_init__(self):
    check_overlong(self, validate(self))
