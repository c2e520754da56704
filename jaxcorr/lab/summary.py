"""Reducing runs to numbers: one run's metrics rows to a summary and curves
(`summarise`, `curves`), a grid's records to per-seed baselines and means
over seeds (`baseline_accuracy`, `aggregate`).

A record is one run as `run_grid` returns it: preset, mismatch, seed,
`summary`, `curves` and timings.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

COLLAPSE_DROP = 0.2
"""A run collapsed if its final eval accuracy is this far below its peak, or
its last-20% reward this far below its first-20% reward, or any loss is
non-finite."""

CURVE_KEYS = (
  'reward/mean',
  'eval/accuracy',
  'response_length/mean',
  'rollout_corr/kl',
  'rollout_corr/k3_kl',
  'rollout_corr/chi2_token',
  'rollout_corr/chi2_seq',
  'rollout_corr/ppl_ratio',
  'rollout_corr/log_ppl_abs_diff',
  'rollout_corr/rejected_token_fraction',
  'rollout_corr/rejected_seq_fraction',
  'rollout_corr/rollout_is_mean',
  'actor/pg_clipfrac',
  'actor/ppo_kl',
  'actor/grad_norm',
  'rollout/staleness_mean',
  'rollout/mixed_version_fraction',
)
"""The per-step metrics `run_grid` keeps in results.json."""

GAP = 'rollout_corr/k3_kl'
"""The metric the lab reports as the size of the engine-trainer gap: k3 of
KL(μ‖π_old), mmean(exp(r) − r − 1) for r = log π_old − log μ, ≥ 0 per
token. Not the signed `rollout_corr/kl` (k1, mmean(−r)): its tokens'
terms cancel, so it can grow while the gap shrinks (and sit near 0 under
a large gap); it stays in the curves, not in the summaries."""

BASELINE = ('disabled', 'none')
"""(preset, mismatch) of the reference run each seed is compared with."""


def series(rows: Sequence[Mapping[str, Any]], key: str) -> list[float]:
  """The values of `key` in the rows that log it, as floats."""
  return [float(r[key]) for r in rows if key in r and r[key] is not None]


def _mean(xs: Sequence[float]) -> float | None:
  return sum(xs) / len(xs) if xs else None


def summarise(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """One run's numbers from its metrics rows (`run_experiment`'s output).

  Returns:
    steps: RL steps logged; initial/final/peak_accuracy: greedy eval
    accuracy at step 0, at the end and at its best; reward_last20 and
    reward_first20: mean `reward/mean` over the last and first 20 % of the
    RL steps (at least one step); max_k3_kl, mean_k3_kl: of
    `rollout_corr/k3_kl`, the mismatch's size (`GAP`); mean_chi2_token;
    max_ppl_dev: largest |ppl_ratio − 1|;
    rejected_token_fraction, rejected_seq_fraction: means over steps;
    mean_staleness (of `rollout/staleness_mean`), max_staleness (of
    `rollout/staleness_max`), mixed_version_fraction (mean share of rows
    sampled by more than one policy version: in-flight weight updates);
    nonfinite: steps with a non-finite actor loss; collapsed (see
    `COLLAPSE_DROP`). Metrics a run does not log (the `off` preset logs no
    `rollout_corr/`) are None.
  """
  rl = [r for r in rows if 'reward/mean' in r]
  acc = series(rows, 'eval/accuracy')
  rewards = series(rl, 'reward/mean')
  n = max(1, math.ceil(0.2 * len(rewards)))
  k3 = series(rl, GAP)
  ppl = series(rl, 'rollout_corr/ppl_ratio')
  losses = series(rl, 'actor/loss')
  stale = series(rl, 'rollout/staleness_max')
  nonfinite = sum(not math.isfinite(x) for x in losses)
  out = {
    'steps': len(rl),
    'initial_accuracy': acc[0] if acc else None,
    'final_accuracy': acc[-1] if acc else None,
    'peak_accuracy': max(acc) if acc else None,
    'reward_first20': _mean(rewards[:n]),
    'reward_last20': _mean(rewards[-n:]),
    'max_k3_kl': max(k3) if k3 else None,
    'mean_k3_kl': _mean(k3),
    'mean_chi2_token': _mean(series(rl, 'rollout_corr/chi2_token')),
    'max_ppl_dev': max(abs(x - 1) for x in ppl) if ppl else None,
    'rejected_token_fraction': _mean(
      series(rl, 'rollout_corr/rejected_token_fraction')
    ),
    'rejected_seq_fraction': _mean(
      series(rl, 'rollout_corr/rejected_seq_fraction')
    ),
    'mean_staleness': _mean(series(rl, 'rollout/staleness_mean')),
    'max_staleness': max(stale) if stale else None,
    'mixed_version_fraction': _mean(
      series(rl, 'rollout/mixed_version_fraction')
    ),
    'nonfinite': nonfinite,
  }
  collapsed = nonfinite > 0
  if acc:
    collapsed |= out['peak_accuracy'] - out['final_accuracy'] > COLLAPSE_DROP
  if rewards:
    collapsed |= out['reward_first20'] - out['reward_last20'] > COLLAPSE_DROP
  out['collapsed'] = bool(collapsed)
  return out


def curves(
  rows: Sequence[Mapping[str, Any]], keys: Iterable[str] = CURVE_KEYS
) -> dict[str, list[list[float]]]:
  """`{metric: [[step, value], ...]}` for the metrics in `keys` a run has."""
  out: dict[str, list[list[float]]] = {}
  for k in keys:
    pts = [
      [int(r['step']), float(f'{float(r[k]):.4g}')]
      for r in rows
      if k in r and r[k] is not None
    ]
    if pts:
      out[k] = pts
  return out


def fill_gap(records: Sequence[dict[str, Any]]) -> None:
  """Records summarised before `mean_k3_kl` existed (the results.json of
  earlier grids) get it from their `GAP` curve, in place: the curve holds
  every RL step's value, to 4 significant digits."""
  for r in records:
    s = r['summary']
    if 'mean_k3_kl' not in s:
      s['mean_k3_kl'] = _mean([v for _, v in r['curves'].get(GAP, [])])


def aggregate(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """One row per (mismatch, preset): the mean of each summary number over
  seeds, the per-seed values of the accuracies and the collapse count."""
  groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
  for r in records:
    groups.setdefault((r['mismatch'], r['preset']), []).append(r)
  out = []
  for (mismatch, preset), rs in groups.items():
    row: dict[str, Any] = {
      'mismatch': mismatch,
      'preset': preset,
      'seeds': [r['seed'] for r in rs],
    }
    for key in rs[0]['summary']:
      vals = [r['summary'][key] for r in rs if r['summary'][key] is not None]
      if key == 'collapsed':
        row[key] = sum(bool(v) for v in vals)
      elif vals:
        row[key] = statistics.fmean(vals)
      else:
        row[key] = None
    for key in ('final_accuracy', 'peak_accuracy', 'reward_last20'):
      row[key + '_per_seed'] = [r['summary'][key] for r in rs]
    out.append(row)
  return out


def baseline_accuracy(
  records: Sequence[Mapping[str, Any]],
) -> dict[int, float]:
  """Seed -> final accuracy of that seed's `BASELINE` run (where it ran).

  Seeds differ in initialisation, and the warm-up alone can end at 0.5 for
  one seed and 0.8 for another; a run is best read against its own seed's
  uncorrected, mismatch-free run rather than against a mean over seeds.
  """
  out = {}
  for r in records:
    if (r['preset'], r['mismatch']) == BASELINE:
      acc = r['summary']['final_accuracy']
      if acc is not None:
        out[r['seed']] = acc
  return out
