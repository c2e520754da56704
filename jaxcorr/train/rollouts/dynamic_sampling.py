"""Dynamic sampling (DAPO): train only on groups whose rewards differ.

A group (the `rollout.samples_per_prompt` rows of one prompt) whose metric
is equal on every row has a zero group-relative advantage under GRPO,
RLOO, OPO or MaxRL: it costs a full update and moves nothing. With
`dynamic_sampling.enabled` such a group is dropped whole and the step's
batch is back-filled from further loader batches ("generation rounds"):

    round r = 0, 1, ...: draw the loader's next batch, sample and score it,
                         keep group g iff max_i m[g, i] > min_i m[g, i]
    until the kept groups fill `rollout.prompts_per_step` (the first ones,
    in draw order; the surplus is discarded, as verl does), or
    r + 1 = `max_gen_rounds`: then `at_cap` decides:
      'error'         stop the run (verl's and NeMo-RL's behaviour);
      'fill_dropped'  fill the rest with the earliest dropped groups (they
                      train with zero advantage; the batch keeps its shape).

m is `reward` (the sequence reward the advantages see: the reward
functions' weighted sum, the agents' turn rewards and the reward-time
overlong penalty; not the KL-in-reward term, which needs the reference
pass) or one reward function's score (`reward/<name>`), e.g. the accuracy
alone when the reward adds a format or length term (verl-recipe #125:
filtering on the shaped score kept groups whose accuracy never varied).

"Equal" is exact: verl tests np.std > 0, which a group of equal values
whose mean rounds (e.g. [0.1] * 3) passes; NeMo-RL tests a per-row
(leave-one-out with RLOO) std and so keeps or drops single rows of a
group (NeMo-RL #4158). docs/algorithms.md lists these divergences;
tests/conformance/dynamic_sampling replays both references.

Round r of step s samples with the step's seed and the prompts' global
indices offset by r whole global batches (`first_prompt`), so a step's
batch is a function of the seed and the loader position only: the same
run resumes exactly, and every round draws from the loader, whose
position therefore counts the dropped groups' prompts too. With several
processes every process goes on while any is short, so all draw the
same number of batches and their loader states stay equal.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxcorr.config.fields import (
  boolean,
  fail,
  integer,
  one_of,
  setting,
  text,
  validate,
)
from jaxcorr.rollout import RolloutBatch
from jaxcorr.train import batch as batch_lib
from jaxcorr.train.tracker.reduction import Metric

REWARD = 'reward'
AT_CAP = ('error', 'fill_dropped')
# Per-round costs: summed over the rounds of a step (the rest of a batch's
# metrics are its first round's, the policy's unfiltered sample).
_SUMMED_TIMES = ('time/rollout', 'time/reward')


@dataclasses.dataclass(frozen=True)
class DynamicSamplingConfig:
  """The `dynamic_sampling` section (module doc; docs/algorithms.md)."""

  enabled: bool = setting(
    False,
    boolean,
    'Drop groups whose metric is equal on every sample and back-fill the '
    "batch with more prompts (verl's algorithm.filter_groups.enable, "
    "NeMo-RL's grpo.use_dynamic_sampling).",
  )
  metric: str = setting(
    REWARD,
    text,
    "What must vary within a group: 'reward' (the sequence reward) or the "
    'name of a function of reward.functions (its score alone, e.g. the '
    "accuracy; verl's filter_groups.metric).",
  )
  max_gen_rounds: int = setting(
    10,
    integer(1),
    'Generation rounds (loader batches) a step may draw at most '
    "(verl's filter_groups.max_num_gen_batches, NeMo-RL's "
    'dynamic_sampling_max_gen_batches; verl reads <= 0 as no cap, which '
    'jaxcorr refuses: a run on data the policy always or never solves '
    'would sample forever).',
  )
  at_cap: str = setting(
    'error',
    one_of(*AT_CAP),
    "When the cap is reached short of a full batch: 'error' stops the "
    "run (verl, NeMo-RL); 'fill_dropped' trains on the kept groups plus "
    'the earliest dropped ones (zero advantage, same batch shape).',
  )

  def __post_init__(self):
    validate(self)


def check(cfg: DynamicSamplingConfig, samples_per_prompt: int, names) -> None:
  """Config-time rules with the `rollout` and `reward` sections: a group
  of one sample never varies, and the metric must be produced."""
  if not cfg.enabled:
    return
  if samples_per_prompt < 2:
    fail(
      'config.dynamic_sampling.enabled',
      True,
      'False with rollout.samples_per_prompt=1 (a group of one sample '
      'never varies; verl keeps such groups, which filters nothing)',
    )
  if cfg.metric != REWARD and cfg.metric not in names:
    allowed = ', '.join(repr(n) for n in (REWARD, *names))
    fail(
      'config.dynamic_sampling.metric',
      cfg.metric,
      f'{allowed} (the sequence reward or a function of reward.functions)',
    )


# ------------------------------------------------------------- decisions


def kept_groups(values: np.ndarray, n: int) -> np.ndarray:
  """`[B]` metric values, a group's n rows adjacent -> `[B / n]` bool:
  the group's values are not all equal (a NaN drops the group)."""
  v = np.asarray(values, np.float64).reshape(-1, n)
  return v.max(1) > v.min(1)


def pick(
  kept: list[np.ndarray], prompts: int, fill_dropped: bool
) -> list[tuple[int, int]]:
  """The `(round, group)` pairs of the step's batch: the first `prompts`
  kept groups in draw order, then (`fill_dropped`) the earliest dropped
  ones up to `prompts`."""
  pairs = [(r, g) for r, k in enumerate(kept) for g in np.flatnonzero(k)]
  out = pairs[:prompts]
  if fill_dropped and len(out) < prompts:
    rest = [(r, g) for r, k in enumerate(kept) for g in np.flatnonzero(~k)]
    out += rest[: prompts - len(out)]
  return [(int(r), int(g)) for r, g in out]


def first_prompt(round_: int, local_prompts: int) -> int:
  """Global index of this process's first prompt in round `round_`: each
  round's prompts get fresh sampling keys (module doc)."""
  count, index = jax.process_count(), jax.process_index()
  return (round_ * count + index) * local_prompts


def any_process(flag: bool) -> bool:
  """Whether `flag` holds on any process (every process calls it)."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils

  flags = multihost_utils.process_allgather(np.asarray([flag], np.int32))
  return bool(np.asarray(flags).any())


class CapReached(ValueError):
  """`at_cap='error'` and a step still short after `max_gen_rounds`."""


# ---------------------------------------------------------------- filler


class Filler:
  """One step's rounds: `add` each scored round until it returns False,
  then `result` is the step's `Scored` (module doc).

  Args:
    run: the `RunConfig`.
    names: the reward functions' names (`RewardScorer.names`: the rows of
      `Scored.scores`).
    step: the RL step the batch is for.
  """

  def __init__(self, run: Any, names: tuple[str, ...], step: int):
    self.cfg = run.dynamic_sampling
    self.n = run.rollout.samples_per_prompt
    self.step = step
    self.names = tuple(names)
    self.overlong = run.reward
    self.max_len = run.rollout.max_new_tokens
    self.pieces: list = []
    self.kept: list[np.ndarray] = []
    self.prompts = 0  # this process's share of the batch, set by round 0

  @property
  def rounds(self) -> int:
    return len(self.pieces)

  def values(self, scored: Any) -> np.ndarray:
    """`[B]` values of the filter's metric (module doc)."""
    if self.cfg.metric != REWARD:
      return np.asarray(scored.scores)[self.names.index(self.cfg.metric)]
    penalty = 0.0
    if self.overlong.overlong_penalty_at == 'reward':
      shaping = batch_lib.overlong_shaping(
        scored.batch, self.overlong, self.max_len
      )
      penalty = shaping.get('penalty', 0.0)
    return np.asarray(scored.rewards, np.float32) + penalty

  def add(self, scored: Any) -> bool:
    """Record a scored round; True when another round is to be drawn.

    Raises:
      CapReached: short after `max_gen_rounds` with `at_cap='error'`.
    """
    if not self.pieces:
      self.prompts = scored.batch.batch_size // self.n
    self.pieces.append(scored)
    self.kept.append(kept_groups(self.values(scored), self.n))
    short = any_process(sum(int(k.sum()) for k in self.kept) < self.prompts)
    if not short or self.rounds < self.cfg.max_gen_rounds:
      return short
    if self.cfg.at_cap == 'error':
      kept = sum(int(k.sum()) for k in self.kept)
      raise CapReached(
        f'config.dynamic_sampling.max_gen_rounds={self.cfg.max_gen_rounds} '
        f'reached at step {self.step}: {kept} of {self.prompts} prompts '
        f'kept (metric {self.cfg.metric!r} equal within every other '
        "group); allowed: a larger cap, at_cap='fill_dropped', or data the "
        'policy neither always nor never solves'
      )
    return False

  def result(self) -> Any:
    """The step's `Scored`: the picked groups' rows in `pick`'s order, group
    ids renumbered, the first round's metrics plus `dynamic_sampling/*`."""
    pairs = pick(self.kept, self.prompts, self.cfg.at_cap == 'fill_dropped')
    first = self.pieces[0]
    if self.rounds == 1 and pairs == [(0, g) for g in range(self.prompts)]:
      out = first  # every group kept in round 0: the batch as drawn
    else:
      out = dataclasses.replace(first, **self._rows(pairs))
    kept = sum(int(k.sum()) for k in self.kept)
    groups = sum(k.size for k in self.kept)
    metrics = dict(first.metrics)
    for key in _SUMMED_TIMES:
      if key in metrics:
        total = sum(float(p.metrics[key].value) for p in self.pieces)
        metrics[key] = Metric.avg(total)
    filled = sum(1 for r, g in pairs if not self.kept[r][g])
    metrics.update(
      {
        'dynamic_sampling/groups_kept': Metric.sum(float(kept)),
        'dynamic_sampling/groups_dropped': Metric.sum(float(groups - kept)),
        'dynamic_sampling/groups_filled_dropped': Metric.sum(float(filled)),
        'dynamic_sampling/gen_rounds': Metric.max(float(self.rounds)),
        'dynamic_sampling/prompts_consumed': Metric.sum(float(groups)),
      }
    )
    out.metrics = metrics
    return out

  def _rows(self, pairs: list[tuple[int, int]]) -> dict[str, Any]:
    """`Scored` fields of the picked groups' rows, in `pairs` order."""
    n, parts, rewards, scores = self.n, [], [], []
    for r, g in pairs:
      rows = np.arange(g * n, (g + 1) * n)
      piece = self.pieces[r]
      parts.append(take_rows(piece.batch, rows))
      rewards.append(np.asarray(piece.rewards)[rows])
      if piece.scores is not None:
        scores.append(np.asarray(piece.scores)[:, rows])
    batch = concat_rows(parts)
    ids = np.repeat(np.arange(len(pairs), dtype=np.int32), n)
    return dict(
      batch=batch.replace(group_id=ids),
      rewards=np.concatenate(rewards),
      scores=np.concatenate(scores, axis=1) if scores else None,
      version=max(p.version for p in self.pieces),
    )


def sample_step(stage: Any, loader: Any, step: int) -> Any:
  """Step `step`'s `Scored` from the loader: one round, or the rounds of
  dynamic sampling when it is enabled (sync and fixed-lag sources)."""
  if not stage.run.dynamic_sampling.enabled:
    return stage.run_step(loader.next_batch(), step=step)
  filler = Filler(stage.run, stage.scorer.names, step)
  more = True
  while more:
    examples = loader.next_batch()
    start = first_prompt(filler.rounds, len(examples))
    more = filler.add(stage.run_step(examples, step=step, first_prompt=start))
  return filler.result()


# ------------------------------------------------------------- row algebra

# Fields laid out [B, P, ...] or [B, P + T, ...]: a longer prompt width P
# pads them on the left (prompts are left-padded).
_PROMPT_AXIS = ('prompt_tokens', 'prompt_mask', 'routed_experts')


def take_rows(batch: RolloutBatch, rows: np.ndarray) -> RolloutBatch:
  """The rows `rows` of a host batch."""
  return jax.tree.map(lambda x: np.asarray(x)[rows], batch)


def concat_rows(parts: list[RolloutBatch]) -> RolloutBatch:
  """Host batches stacked by rows, their prompt widths padded on the left
  to the widest (`driver.to_batch` sizes P to a batch's longest prompt)."""
  if len(parts) == 1:
    return parts[0]
  widths = [b.prompt_tokens.shape[1] for b in parts]
  p = max(widths)
  out = {}
  for f in dataclasses.fields(parts[0]):
    values = [getattr(b, f.name) for b in parts]
    if not f.metadata.get('pytree_node', True) or values[0] is None:
      out[f.name] = values[0]
      continue
    if f.name in _PROMPT_AXIS:
      values = [_pad_left(v, p - w) for v, w in zip(values, widths)]
    out[f.name] = np.concatenate([np.asarray(v) for v in values])
  return RolloutBatch(**out)


def _pad_left(x: Any, pad: int) -> np.ndarray:
  x = np.asarray(x)
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (pad, 0)
  return np.pad(x, widths)
