"""Evaluation of the current weights on held-out prompts, as the rollout
engine runs them (its dtype and quantisation): per eval set, greedy
accuracy, and with `eval.samples` > 0 a sampled pass for pass@k / maj@k
(jaxcorr/train/evals/, docs/evaluation.md).

Sync mode evaluates on the training engine, which already holds the current
weights. In async mode the producer owns that engine, so evaluation runs on
an engine of its own on the trainer's devices and loads the weights first.
Every process decodes its share of the prompts; the metrics are combined
over processes (`reduction.gather_processes`).

Progress: the sampled pass decodes `CHUNK_ROWS` replies at a time (whole
prompts: `CHUNK_ROWS // eval.samples`, at least one); with more than one
chunk, a progress line (`metrics.ProgressLine`, the training line's style)
follows each, e.g. `eval/add/sampled prompts 64/256 | 0.9 s/prompt | ETA
2m53s`. Chunking changes no reply: a reply's sampling key is that of its
prompt's index in the set and its sample's (`driver.request_keys`).

Seeds: the greedy pass samples with step `_SEED_OFFSET + step` (as it always
has: with the default `eval` section the metrics are those of a run before
the sampled pass existed), the sampled pass of set i with
`_SAMPLED_OFFSET + step * _MAX_SETS + i`; both far from any training step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxcorr.data import prompts as data
from jaxcorr.data.tasks import Example
from jaxcorr.train.evals import sampled, samples_log
from jaxcorr.train.evals.sets import EvalSet, build_sets
from jaxcorr.train.rollouts.stage import RolloutStage, Scored
from jaxcorr.train.tracker import reduction
from jaxcorr.train.tracker.metrics import ProgressLine
from jaxcorr.train.tracker.reduction import Metric, Metrics

# Evaluation's sampling seeds: far from any training step's.
_SEED_OFFSET = 10**9
_SAMPLED_OFFSET = 2 * 10**9
_MAX_SETS = 1000

# Replies per chunk of the sampled pass: a progress line per chunk (about
# a minute of decoding on 2 CPU cores for the tiny models).
CHUNK_ROWS = 512


class Evaluator:
  """`evaluator(step)` -> `eval/` metrics of the weights after `step`.

  Args:
    stage: generation and scoring on the engine evaluation uses; its run's
      `eval` section says what runs.
    sets: the eval sets (`jaxcorr.train.evals.sets.build_sets`), each with
      this process's share of its prompts.
    weights: () -> the engine's copy of the current weights; None when the
      stage's engine is the training one (it holds them already).
    samples_dir: where the JSONL of eval samples goes
      (`jaxcorr.train.evals.samples_log`); None: nowhere.
    chunk_rows: replies decoded per chunk of the sampled pass (module doc).
  """

  def __init__(
    self,
    stage: RolloutStage,
    sets: Sequence[EvalSet],
    weights: Callable[[], Any] | None = None,
    *,
    samples_dir: str | None = None,
    chunk_rows: int = CHUNK_ROWS,
  ):
    self.stage = stage
    self.chunk_rows = chunk_rows
    self.sets = list(sets)
    self.weights = weights
    cfg = stage.run.eval
    self.samples_dir = samples_dir if cfg.samples_jsonl else None
    self._answer = sampled.answer_of(stage.scorer.names[0])

  def __call__(self, step: int) -> dict[str, float]:
    if self.weights is not None:
      self.stage.engine.update_params(self.weights(), version=step)
    ev: Metrics = {}
    rows: list[dict] = []
    for i, eval_set in enumerate(self.sets):
      if not eval_set.examples:
        continue
      metrics = self._greedy(eval_set, step, rows)
      if 'time/eval' in ev:  # several sets: the time of them all
        spent = ev['time/eval'].value + metrics['time/eval'].value
        metrics['time/eval'] = Metric.avg(spent)
      ev.update(metrics)
      if self.stage.run.eval.samples:
        ev.update(self._sampled(eval_set, i, step, rows))
    if self.samples_dir is not None and rows:
      samples_log.write(self.samples_dir, step, rows)
    return reduction.gather_processes(ev)

  def _greedy(self, eval_set: EvalSet, step: int, rows: list) -> Metrics:
    stage = self.stage
    scored = stage.run_step(
      eval_set.examples, step=_SEED_OFFSET + step, greedy=True
    )
    if self.samples_dir is not None:
      replies = stage.responses(scored.batch)
      rows.extend(self._rows(eval_set, scored, replies, step, 'greedy'))
    return _rename(stage.eval_metrics(scored), eval_set.prefix)

  def _sampled(
    self, eval_set: EvalSet, index: int, step: int, rows: list
  ) -> Metrics:
    """pass@k, maj@k, sampled accuracy (`jaxcorr.train.evals.sampled`),
    decoded in chunks of prompts (module doc: progress)."""
    run = self.stage.run
    cfg = run.eval
    preset = cfg.preset_for(run.rollout)
    examples = eval_set.examples
    size = max(1, self.chunk_rows // cfg.samples)
    starts = range(0, len(examples), size)
    progress = None
    if len(starts) > 1:
      progress = ProgressLine(
        len(examples),
        label=f'{eval_set.prefix}sampled prompts',
        unit='prompt',
      )
    base = jax.process_index() * len(examples)  # stage.sample's default
    replies, scores, seconds = [], [], 0.0
    for first in starts:
      chunk = EvalSet(eval_set.name, examples[first : first + size])
      t0 = time.perf_counter()
      scored = self.stage.sample(
        chunk.examples,
        step=_SAMPLED_OFFSET + step * _MAX_SETS + index,
        num_samples=cfg.samples,
        temperature=preset.temperature,
        top_k=preset.top_k,
        top_p=preset.top_p,
        min_p=preset.min_p,
        first_prompt=base + first,
      )
      got = self.stage.responses(scored.batch)
      if self.samples_dir is not None:
        rows.extend(self._rows(chunk, scored, got, step, 'sampled', first))
      replies += got
      scores.append(np.asarray(scored.scores[0]))
      seconds += float(scored.metrics['time/rollout'].value)
      if progress is not None:
        done = first + len(chunk.examples)
        spent = time.perf_counter() - t0
        progress.update(done, {}, spent / len(chunk.examples))
    values = sampled.sampled_metrics(
      np.concatenate(scores),
      replies,
      samples=cfg.samples,
      ks=cfg.ks,
      answer=self._answer,
    )
    out = {f'{eval_set.prefix}{k}': Metric.avg(v) for k, v in values.items()}
    timer = 'time/eval_sampled' + (f'/{eval_set.name}' if eval_set.name else '')
    out[timer] = Metric.avg(seconds)
    return out

  def _rows(
    self,
    eval_set: EvalSet,
    scored: Scored,
    replies: Sequence[str],
    step: int,
    mode: str,
    first: int = 0,
  ) -> list[dict]:
    """The JSONL rows of one pass (`jaxcorr.train.evals.samples_log`);
    `first`: the set's index of `eval_set.examples[0]` (a chunk's)."""
    n = len(replies) // len(eval_set.examples)
    template = self.stage.run.data.prompt_template
    out = []
    for j, reply in enumerate(replies):
      ex = eval_set.examples[j // n]
      out.append(
        {
          'step': step,
          'set': eval_set.name,
          'mode': mode,
          'prompt_index': first + j // n,
          'sample': j % n,
          'prompt': data.format_prompt(template, ex),
          'answer': ex.answer,
          'reply': reply,
          'reward': float(scored.rewards[j]),
          'score': float(scored.scores[0][j]),
        }
      )
    return out


def build_evaluator(
  stage: RolloutStage,
  default: Sequence[Example],
  weights: Callable[[], Any] | None = None,
  *,
  workdir: str | None = None,
) -> Evaluator:
  """The run's `Evaluator`: its eval sets (`build_sets`, `default`: this
  process's share of the data section's held-out prompts) and the JSONL of
  eval samples under `<workdir>/eval_samples` (None: none written)."""
  sets = build_sets(stage.run, default, stage.tokenizer.encode)
  samples_dir = None if workdir is None else f'{workdir}/{samples_log.DIRNAME}'
  return Evaluator(stage, sets, weights, samples_dir=samples_dir)


def _rename(metrics: Metrics, prefix: str) -> Metrics:
  """`eval/x` -> `<prefix>x` (a named set's metrics)."""
  if prefix == 'eval/':
    return metrics
  return {
    (prefix + k[len('eval/') :] if k.startswith('eval/') else k): v
    for k, v in metrics.items()
  }
