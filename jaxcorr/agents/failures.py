"""What an environment does wrong, and when the run stops for it
(docs/agents.md, "Containment").

The policy: an environment failure ends that trajectory, never the
step. A failure is any of

    make / reset      `EnvironmentSpec.make` or `Environment.reset` raised
    step              `Environment.step` raised, or returned something
                      that is not a `StepResult`
    result            the `StepResult` is unusable: a turn reward that is
                      not a finite number, `info` values that are not
                      finite numbers, an observation that is neither
                      messages (dicts) nor token ids in [0, vocabulary)
    demonstration     the expert or the environment failed while playing
                      a demonstration for the SFT warm-up

A failed trajectory keeps what it sampled but becomes an ABORT row (the
update drops it, as it drops the engine's aborted rows; its turn rewards
are the finite ones before the failure) and counts in `agent/env_errors`;
a failed demonstration becomes an empty row (no loss). Each batch (and
each warm-up batch) is then checked once: more failures than
`config.agent.max_env_error_fraction` of it stops the run with
`EnvironmentFailing`, one line naming the environment, the count and the
first failure (where it was raised); fewer are a warning line. The
engine's own ERROR rows stay bounded by `rollout.max_error_fraction`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import logging

from jaxcorr.agents.environment import StepResult


class EnvironmentFailing(RuntimeError):
  """An environment failed on more of a batch than the bound allows."""


class BadResult(ValueError):
  """`Environment.step` returned something unusable (module docstring)."""


def describe(stage: str, err: BaseException) -> str:
  """One line: where it failed, the exception and its innermost frame
  ('step: ValueError: boom (my_env.py:12)')."""
  where = ''
  frames = traceback.extract_tb(err.__traceback__)
  if frames and not isinstance(err, BadResult):  # BadResult: ours
    where = f' ({frames[-1].filename}:{frames[-1].lineno})'
  text = ' '.join(str(err).split())[:200]
  return f'{stage}: {type(err).__name__}: {text}{where}'


def check_result(result: Any, vocab_size: int) -> StepResult:
  """`result` with its observation as a list (messages or int ids) when
  usable; `BadResult` saying what is wrong."""
  if not isinstance(result, StepResult):
    raise BadResult(f'step returned {type(result).__name__}, not a StepResult')
  if not _finite(result.reward):
    raise BadResult(f'the turn reward {result.reward!r} is not a finite number')
  for key, value in result.info.items():
    if not _finite(value):
      raise BadResult(f'info[{key!r}] = {value!r} is not a finite number')
  obs = result.observation
  if isinstance(obs, np.ndarray):
    obs = obs.tolist()
  if not isinstance(obs, Sequence) or isinstance(obs, str | bytes):
    raise BadResult(
      f'the observation is a {type(obs).__name__}, not a list of messages '
      'or token ids'
    )
  if all(isinstance(m, dict) for m in obs):
    return dataclasses.replace(result, observation=list(obs))
  for i in obs:
    if not isinstance(i, numbers.Integral) or isinstance(i, bool):
      raise BadResult(
        f'the observation mixes messages and ids, or holds {i!r}: allowed '
        'a list of message dicts or a list of token ids'
      )
    if not 0 <= int(i) < vocab_size:
      raise BadResult(
        f'observation id {int(i)} is outside the vocabulary [0, {vocab_size})'
      )
  return dataclasses.replace(result, observation=[int(i) for i in obs])


def _finite(value: Any) -> bool:
  return (
    isinstance(value, numbers.Real)
    and not isinstance(value, bool)
    and math.isfinite(value)
  )


def check_bound(
  environment: str, errors: Sequence[str], total: int, bound: float, what: str
) -> None:
  """Stop (`EnvironmentFailing`) when `len(errors)` of `total` `what`
  exceeds `bound`; warn when some failed (module docstring)."""
  if not errors:
    return
  line = (
    f'environment {environment!r} failed on {len(errors)} of {total} {what}'
  )
  if len(errors) > bound * total:
    raise EnvironmentFailing(
      f'{line} (> config.agent.max_env_error_fraction={bound}); '
      f'first: {errors[0]}'
    )
  logging.warning(
    '%s (agent/env_errors; the run stops above '
    'config.agent.max_env_error_fraction=%s); first: %s',
    line,
    bound,
    errors[0],
  )
