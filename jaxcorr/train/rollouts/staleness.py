"""Per-token staleness on the host: `rollout.staleness_policy` and the
`staleness/` metrics (docs/math/rollout_contract.md §6).

At trainer step s a token sampled by policy version v has staleness (version
gap) s − v. In stream mode one row carries several versions (the engine took
new weights while the row was in flight), and its gap splits in two:

    s − v  =  (newest_i − v)  +  (s − newest_i)
              in flight           queued

with newest_i the newest version in the token's row: the updates the engine
took while the row was still decoding, and those the trainer made after the
row's last token (its time in the queue). The policies:

    wait, drop   a row whose oldest token is staler than max_staleness is
                 dropped whole (an empty row); for 'wait' the producer
                 never delivers one, so this is a safety net
    mask         only the tokens staler than max_staleness leave
                 response_mask; a row left without tokens is an empty row

A masked stale token is like any other masked token in every term, the
correction's sequence-level statistics included: the correction sees the
one mask `assemble` builds (jaxcorr/train/batch.py).

A batch can be left with no token at all (every row too stale, or an
engine error): its update trains on nothing. `EmptyBatches` warns on each
such batch and stops the run after `rollout.max_empty_batches` of them in
a row, naming the settings to change, as `rollout.max_error_fraction` stops
a run of ERROR rows.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from absl import logging

from jaxcorr.rollout import RolloutBatch
from jaxcorr.train.rollouts.config import STALENESS_POLICIES
from jaxcorr.train.tracker.reduction import Metric, Metrics

MAX_GAP_BUCKETS = 6


def check_policy(policy: str) -> None:
  if policy not in STALENESS_POLICIES:
    raise ValueError(
      f'rollout.staleness_policy={policy!r}; allowed: '
      + ', '.join(repr(p) for p in STALENESS_POLICIES)
    )


def gap_buckets(mode: str, max_staleness: int | None) -> int | None:
  """G, the version-gap buckets of the `staleness/` histograms and of the
  correction's `rollout_corr/gap<g>/` metrics (the last bucket is open);
  None for `rollout.mode='sync'` (no split, no metrics).

  One bucket per allowed gap 0..max_staleness and one for the tokens above
  the bound, at most `MAX_GAP_BUCKETS` so the key set stays small.
  """
  if mode == 'sync':
    return None
  if max_staleness is None:
    raise ValueError(
      f'rollout.max_staleness=None with rollout.mode={mode!r}; allowed: an '
      'int >= 0'
    )
  return max(2, min(max_staleness + 2, MAX_GAP_BUCKETS))


def token_gap(batch: RolloutBatch, trainer_version: int) -> np.ndarray:
  """[B, T] int32 trainer_version − policy_version on response_mask, 0 off
  it."""
  mask = np.asarray(batch.response_mask, bool)
  gap = trainer_version - np.asarray(batch.policy_version, np.int64)
  return np.where(mask, gap, 0).astype(np.int32)


def stale_tokens(
  batch: RolloutBatch, trainer_version: int, max_staleness: int | None
) -> np.ndarray:
  """[B, T] bool: response tokens staler than `max_staleness` (None: none)."""
  mask = np.asarray(batch.response_mask, bool)
  if max_staleness is None:
    return np.zeros_like(mask)
  return mask & (token_gap(batch, trainer_version) > max_staleness)


def distinct_per_row(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
  """[B] number of distinct `values` (>= 0) on each row's mask."""
  s = np.sort(np.where(mask, values, -1), axis=1)
  first = np.ones_like(s, bool)
  first[:, 1:] = s[:, 1:] != s[:, :-1]
  return (first & (s >= 0)).sum(1)


def _hist(gap: np.ndarray, buckets: int, n: int) -> list[float]:
  counts = np.bincount(np.minimum(gap, buckets - 1), minlength=buckets)
  return [float(c) / max(n, 1) for c in counts]


def staleness_metrics(
  batch: RolloutBatch,
  *,
  trainer_version: int,
  real: np.ndarray,
  trained: np.ndarray,
  buckets: int,
) -> Metrics:
  """`staleness/` metrics and `rollout/versions_per_seq_mean`,
  `rollout/token_keep_fraction` of one batch (async and stream modes).

  Token metrics are over the response tokens of the real (non-PAD) rows,
  row metrics over the real rows with a response token; both are means
  weighted by that count across processes (`Reduce.WMEAN`).

  Args:
    batch: the host batch (numpy).
    trainer_version: the trainer's step.
    real: [B] bool non-PAD rows.
    trained: [B, T] bool the response tokens that train (after dropping
      rows and the staleness policy).
    buckets: G histogram buckets, the last one open.
  """
  mask = np.asarray(batch.response_mask, bool) & real[:, None]
  version = np.asarray(batch.policy_version, np.int64)
  n_tok = int(mask.sum())
  rows = mask.any(1)
  n_rows = int(rows.sum())
  gap = np.where(mask, trainer_version - version, 0)
  newest = np.where(mask, version, -1).max(1)[:, None]
  inflight = np.where(mask, newest - version, 0)[mask]
  queued = np.where(mask, trainer_version - newest, 0)[mask]
  lengths = np.maximum(mask.sum(1), 1)
  seq_max = gap.max(1)[rows]
  seq_mean = (gap.sum(1) / lengths)[rows]
  versions = distinct_per_row(version, mask)[rows]

  def tok(x: float) -> Metric:
    return Metric.wavg(float(x), float(n_tok))

  def row(x: np.ndarray) -> Metric:
    return Metric.wavg(float(x.mean()) if n_rows else 0.0, float(n_rows))

  m = {
    'staleness/token_mean': tok(gap[mask].mean() if n_tok else 0.0),
    'staleness/token_max': Metric.max(float(gap.max(initial=0))),
    'staleness/inflight_mean': tok(inflight.mean() if n_tok else 0.0),
    'staleness/queued_mean': tok(queued.mean() if n_tok else 0.0),
    'staleness/seq_max_mean': row(seq_max),
    'staleness/seq_mean_mean': row(seq_mean),
    'rollout/versions_per_seq_mean': row(versions),
    'rollout/token_keep_fraction': tok(
      (trained & mask).sum() / n_tok if n_tok else 0.0
    ),
  }
  for name, g in (('inflight', inflight), ('queued', queued)):
    for b, frac in enumerate(_hist(g, buckets, n_tok)):
      m[f'staleness/{name}_hist{b}'] = tok(frac)
  return m


class EmptyBatches:
  """Counts batches in a row with no token to train (module doc).

  Args:
    limit: `rollout.max_empty_batches`, the run of empty batches tolerated.
    policy, max_staleness, queue_size: the rollout settings the messages
      name.
  """

  def __init__(
    self,
    *,
    limit: int,
    policy: str,
    max_staleness: int | None,
    queue_size: int,
  ):
    self.limit = limit
    self.policy, self.max_staleness = policy, max_staleness
    self.queue_size = queue_size
    self.in_a_row = 0  # empty batches in a row so far

  def check(
    self, step: int, valid_tokens: float, metrics: Mapping[str, float]
  ) -> None:
    """After the update of batch `step` (`batch/valid_tokens` of the whole
    batch, and its host `metrics`): warn if it trained on nothing, raise a
    RuntimeError once more than `limit` did in a row."""
    if valid_tokens > 0:
      self.in_a_row = 0
      return
    self.in_a_row += 1
    stale = metrics.get('rollout/stale_dropped_fraction', 0.0)
    errors = metrics.get('rollout/finish_error_fraction', 0.0)
    errors += metrics.get('rollout/finish_abort_fraction', 0.0)
    if stale > 0 or errors == 0:
      why = (
        f'{stale:.0%} of the rows dropped as staler than '
        f'rollout.max_staleness={self.max_staleness} '
        f'(rollout.staleness_policy={self.policy!r})'
      )
      fix = (
        "rollout.staleness_policy='wait', a larger rollout.max_staleness "
        f'or a smaller rollout.queue_size (now {self.queue_size})'
      )
    elif metrics.get('agent/env_errors', 0.0) > 0:
      # An environment's failure ends its trajectory as an ABORT row
      # (jaxcorr/agents/failures.py): name the environment, not the engine.
      why = (
        f'{errors:.0%} of the rows are ERROR or ABORT rows, '
        f"{metrics['agent/env_errors']:.0f} of them the environment's "
        'failures (agent/env_errors)'
      )
      fix = 'the environment (the warning lines above name its first failure)'
    else:
      why = f'{errors:.0%} of the rows are engine ERROR or ABORT rows'
      fix = 'the engine (its log says why it failed the rows)'
    msg = f'step {step + 1} trained on nothing: no response token left ({why})'
    if self.in_a_row > self.limit:
      raise RuntimeError(
        f'{msg}; {self.in_a_row} such batches in a row > '
        f'rollout.max_empty_batches={self.limit}: change {fix}'
      )
    logging.warning('%s; check %s', msg, fix)
