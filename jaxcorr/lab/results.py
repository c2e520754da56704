"""A grid's results on disk: the markdown tables (`markdown_table`, and
`spread_table` for means and spread over seeds) and the output directory
(`write_results`: results.json, results.md and the PNGs; `load_results`
reads the records back, `write_tables` rewrites results.md from them)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jaxcorr.lab.plots import save_plots
from jaxcorr.lab.summary import aggregate, baseline_accuracy, fill_gap

if TYPE_CHECKING:  # runs.py imports this module
  from jaxcorr.lab.config import Grid


def fmt(x: float | None, sig: int = 3) -> str:
  """`x` for a table or a progress line: `sig` decimals, or scientific
  notation for tiny and huge values; None is '–'."""
  if x is None:
    return '–'
  if x != 0 and (abs(x) < 10.0**-sig or abs(x) >= 1e4):
    return f'{x:.{max(sig - 1, 1)}e}'
  return f'{x:.{sig}f}'


def markdown_table(
  records: Sequence[Mapping[str, Any]], *, per_seed: bool = True
) -> str:
  """The results table in markdown.

  `per_seed`: one row per run, with `Δ base`, the final accuracy minus
  that of the same seed's `BASELINE` run. Otherwise one row per (mismatch,
  preset) with means over seeds and the per-seed final accuracies.
  """
  head = (
    '| mismatch | preset | {seed} | acc@0 | final acc | {delta} | peak acc '
    '| reward last 20% | max k3 | mean χ²_token | max \\|ppl−1\\| '
    '| rejected tok | collapsed |'
  )
  lines = [
    head.format(
      seed='seed' if per_seed else 'seeds',
      delta='Δ base' if per_seed else '(per seed)',
    ),
    '|' + '---|' * 13,
  ]

  def cells(row: Mapping[str, Any]) -> str:
    return (
      f'{fmt(row["peak_accuracy"])} | {fmt(row["reward_last20"])} | '
      f'{fmt(row["max_k3_kl"], 2)} | {fmt(row["mean_chi2_token"], 2)} | '
      f'{fmt(row["max_ppl_dev"], 2)} | '
      f'{fmt(row["rejected_token_fraction"], 2)}'
    )

  if per_seed:
    base = baseline_accuracy(records)
    for r in records:
      s = r['summary']
      b = base.get(r['seed'])
      delta = (
        '–'
        if b is None or s['final_accuracy'] is None
        else f'{s["final_accuracy"] - b:+.3f}'
      )
      lines.append(
        f'| {r["mismatch"]} | `{r["preset"]}` | {r["seed"]} | '
        f'{fmt(s["initial_accuracy"])} | {fmt(s["final_accuracy"])} | '
        f'{delta} | {cells(s)} | {"yes" if s["collapsed"] else "no"} |'
      )
  else:
    for row in aggregate(records):
      seeds = ', '.join(fmt(x) for x in row['final_accuracy_per_seed'])
      lines.append(
        f'| {row["mismatch"]} | `{row["preset"]}` | '
        f'{",".join(map(str, row["seeds"]))} | '
        f'{fmt(row["initial_accuracy"])} | '
        f'{fmt(row["final_accuracy"])} | ({seeds}) | {cells(row)} | '
        f'{row["collapsed"]}/{len(row["seeds"])} |'
      )
  return '\n'.join(lines) + '\n'


def _mean_sd(xs: Sequence[float | None], sig: int = 3) -> str:
  """'mean ± sample sd' of the values that exist ('–' for none, no sd for
  one)."""
  xs = [x for x in xs if x is not None]
  if not xs:
    return '–'
  if len(xs) == 1:
    return fmt(xs[0], sig)
  return f'{fmt(statistics.fmean(xs), sig)} ± {fmt(statistics.stdev(xs), sig)}'


def spread_table(records: Sequence[Mapping[str, Any]]) -> str:
  """One row per (mismatch, preset): mean ± sample standard deviation over
  seeds of the final accuracy, of `Δ base` (against each seed's own
  `BASELINE` run) and of the last-20% reward; the mean over seeds of the
  mean k3 KL (`summary.GAP`), of the staleness (mean, and the largest seen) and
  of the share of rows that mixed policy versions; collapsed runs."""
  base = baseline_accuracy(records)
  groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
  for r in records:
    groups.setdefault((r['mismatch'], r['preset']), []).append(r)
  lines = [
    '| mismatch | preset | seeds | final acc | Δ base | reward last 20% '
    '| mean k3 | staleness mean (max) | mixed-version rows | collapsed |',
    '|' + '---|' * 10,
  ]
  for (mismatch, preset), rs in groups.items():
    ss = [r['summary'] for r in rs]

    def get(key: str, ss=ss) -> list[Any]:
      return [s.get(key) for s in ss]

    delta = [
      s['final_accuracy'] - base[r['seed']]
      if r['seed'] in base and s['final_accuracy'] is not None
      else None
      for r, s in zip(rs, ss)
    ]
    k3 = [x for x in get('mean_k3_kl') if x is not None]
    stale = [x for x in get('mean_staleness') if x is not None]
    worst = [x for x in get('max_staleness') if x is not None]
    mixed = [x for x in get('mixed_version_fraction') if x is not None]
    staleness = '–'
    if stale:
      staleness = f'{statistics.fmean(stale):.2f} ({max(worst):.0f})'
    lines.append(
      f'| {mismatch} | `{preset}` | {",".join(str(r["seed"]) for r in rs)} '
      f'| {_mean_sd(get("final_accuracy"))} | {_mean_sd(delta)} '
      f'| {_mean_sd(get("reward_last20"))} '
      f'| {fmt(statistics.fmean(k3), 2) if k3 else "–"} | {staleness} '
      f'| {fmt(statistics.fmean(mixed), 2) if mixed else "–"} '
      f'| {sum(bool(s["collapsed"]) for s in ss)}/{len(rs)} |'
    )
  return '\n'.join(lines) + '\n'


def write_results(
  records: Sequence[Mapping[str, Any]],
  out: str,
  *,
  plan: Sequence[Grid] = (),
  plots: bool = True,
) -> None:
  """results.json (the plan and the records), results.md (the table) and
  the PNGs."""
  os.makedirs(out, exist_ok=True)
  meta = [dataclasses.asdict(g) for g in plan]
  with open(os.path.join(out, 'results.json'), 'w') as f:
    # One run per line: readable diffs, a tenth of an indented dump's size.
    f.write('{"plan": ' + json.dumps(meta) + ',\n "runs": [\n')
    runs = [json.dumps(r, separators=(',', ':')) for r in _finite(records)]
    f.write(',\n'.join(runs) + '\n]}\n')
  write_tables(records, out)
  if plots:
    save_plots(records, out)


def write_tables(records: Sequence[Mapping[str, Any]], out: str) -> None:
  """results.md: every run's row, and with several seeds the means and
  spreads over them (atomically: a reader never sees half a table)."""
  parts = ['# Mismatch lab results\n\nOne row per run:\n\n']
  parts.append(markdown_table(records))
  if any(len(r['seeds']) > 1 for r in aggregate(records)):
    parts += [
      '\nMeans over seeds:\n\n',
      markdown_table(records, per_seed=False),
    ]
    parts += ['\nMeans ± sample standard deviation over seeds:\n\n']
    parts.append(spread_table(records))
  path = os.path.join(out, 'results.md')
  with open(path + '.tmp', 'w') as f:
    f.write(''.join(parts))
  os.replace(path + '.tmp', path)


def _finite(x: Any) -> Any:
  """NaN and ±inf -> None, so results.json is standard JSON."""
  if isinstance(x, float) and not math.isfinite(x):
    return None
  if isinstance(x, dict):
    return {k: _finite(v) for k, v in x.items()}
  if isinstance(x, list | tuple):
    return [_finite(v) for v in x]
  return x


def load_results(path: str) -> list[dict[str, Any]]:
  """The records of a results.json (a file or the directory holding it),
  older ones with the summary numbers added since (`fill_gap`)."""
  if os.path.isdir(path):
    path = os.path.join(path, 'results.json')
  with open(path) as f:
    records = json.load(f)['runs']
  fill_gap(records)
  return records
