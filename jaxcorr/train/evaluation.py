"""Greedy accuracy of the current weights on the held-out prompts, as the
rollout engine runs them (its dtype and quantisation).

Sync mode evaluates on the training engine, which already holds the current
weights. In async mode the producer owns that engine, so evaluation runs on
an engine of its own on the trainer's devices and loads the weights first.
Every process decodes its share of the prompts; the metrics are combined
over processes (`reduction.gather_processes`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jaxcorr.data.tasks import Example
from jaxcorr.train.rollouts.stage import RolloutStage
from jaxcorr.train.tracker import reduction

# Evaluation's sampling seeds: far from any training step's.
_SEED_OFFSET = 10**9


class Evaluator:
  """`evaluator(step)` -> `eval/` metrics of the weights after `step`.

  Args:
    stage: generation and scoring on the engine evaluation uses.
    examples: this process's held-out prompts.
    weights: () -> the engine's copy of the current weights; None when the
      stage's engine is the training one (it holds them already).
  """

  def __init__(
    self,
    stage: RolloutStage,
    examples: Sequence[Example],
    weights: Callable[[], Any] | None = None,
  ):
    self.stage = stage
    self.examples = list(examples)
    self.weights = weights

  def __call__(self, step: int) -> dict[str, float]:
    if self.weights is not None:
      self.stage.engine.update_params(self.weights(), version=step)
    ev = self.stage.evaluate(self.examples, step=_SEED_OFFSET + step)
    return reduction.gather_processes(ev)
