"""The lab's figures (matplotlib, imported when a figure is drawn): curves
of one metric over RL steps (`plot_metric` and the figures built on it),
the final accuracy of every run, and `save_plots`, which writes a grid's
PNGs."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxcorr.lab.summary import BASELINE, baseline_accuracy


def _smooth(ys: Sequence[float], window: int) -> list[float]:
  """Trailing moving average (reward per step is noisy: 32 prompts)."""
  out, acc = [], 0.0
  for i, y in enumerate(ys):
    acc += y
    if i >= window:
      acc -= ys[i - window]
    out.append(acc / min(i + 1, window))
  return out


def _select(records, **where) -> list[Mapping[str, Any]]:
  return [
    r
    for r in records
    if all(r[k] == v for k, v in where.items() if v is not None)
  ]


def plot_metric(
  records: Sequence[Mapping[str, Any]],
  metric: str,
  *,
  by: str = 'preset',
  ax: Any = None,
  smooth: int = 1,
  logy: bool = False,
  transform: Callable[[float], float] | None = None,
  title: str | None = None,
  **where: Any,
) -> Any:
  """One line per value of `by` ('preset' or 'mismatch'): the seed mean of
  `metric` over steps, seeds as thin lines; `where` filters records
  (`mismatch='stale4'`, `seed=0`); `transform` maps each value before
  smoothing (e.g. to |x − 1|). Returns the axes."""
  import matplotlib.pyplot as plt

  if ax is None:
    _, ax = plt.subplots(figsize=(6, 3.5))
  recs = _select(records, **where)
  order = list(dict.fromkeys(r[by] for r in recs))
  for j, name in enumerate(order):
    color = f'C{j % 10}'
    f = transform or (lambda v: v)
    runs = [
      {step: f(v) for step, v in r['curves'][metric] if v is not None}
      for r in recs
      if r[by] == name and r['curves'].get(metric)
    ]
    if not runs:
      continue
    for c in runs if len(runs) > 1 else ():
      ax.plot(
        list(c), _smooth(list(c.values()), smooth), color=color, alpha=0.25
      )
    steps = sorted(set.intersection(*(set(c) for c in runs)))
    means = [statistics.fmean(c[s] for c in runs) for s in steps]
    ax.plot(steps, _smooth(means, smooth), color=color, lw=1.6, label=name)
  if logy:
    ax.set_yscale('log')
  ax.set_xlabel('RL step')
  ax.set_ylabel(metric)
  ax.set_title(title or metric + (f' ({_where(where)})' if where else ''))
  ax.grid(alpha=0.3)
  return ax


def _legend(ax: Any, **kw: Any) -> None:
  """A legend, if anything was drawn (matplotlib warns otherwise)."""
  if ax.get_legend_handles_labels()[0]:
    ax.legend(**kw)


def _where(where: Mapping[str, Any]) -> str:
  return ', '.join(f'{k}={v}' for k, v in where.items() if v is not None)


def plot_rewards(
  records: Sequence[Mapping[str, Any]],
  mismatch: str | None = None,
  *,
  preset: str | None = None,
  seed: int | None = None,
  smooth: int = 5,
) -> Any:
  """Training reward and greedy eval accuracy: one line per preset under
  `mismatch`, or, given `preset` instead, one line per mismatch. Returns
  the figure."""
  import matplotlib.pyplot as plt

  by = 'mismatch' if mismatch is None else 'preset'
  where = dict(mismatch=mismatch, preset=preset, seed=seed)
  fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
  plot_metric(records, 'reward/mean', by=by, ax=axes[0], smooth=smooth, **where)
  plot_metric(records, 'eval/accuracy', by=by, ax=axes[1], **where)
  _legend(axes[1], fontsize=7, loc='best')
  fig.tight_layout()
  return fig


DIAGNOSTICS = (
  ('rollout_corr/k3_kl', 'k3 KL(μ‖π_old)', abs),
  ('rollout_corr/chi2_token', 'χ²_token = E[ρ²] − 1', abs),
  ('rollout_corr/log_ppl_abs_diff', 'mean |Δ log PPL| per sequence', abs),
)
"""Mismatch-size curves of `plot_diagnostics`: metric, title, transform to
a magnitude (k3 and χ² are ≥ 0 up to rounding, which a log axis cannot
show)."""


def plot_diagnostics(
  records: Sequence[Mapping[str, Any]],
  *,
  preset: str = 'disabled',
  seed: int | None = None,
  smooth: int = 1,
) -> Any:
  """k3 KL, χ²_token and the log-perplexity gap per mismatch for one
  preset, on log axes (the `disabled` preset logs them without changing
  the update): how large each injected mismatch is. Returns the figure."""
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(15, 3.6))
  for ax, (metric, title, f) in zip(axes, DIAGNOSTICS):
    plot_metric(
      records,
      metric,
      by='mismatch',
      ax=ax,
      smooth=smooth,
      logy=True,
      transform=lambda v, f=f: max(f(v), 1e-10),
      title=f'{title} ({_where(dict(preset=preset, seed=seed))})',
      preset=preset,
      seed=seed,
    )
  _legend(axes[0], fontsize=7)
  fig.tight_layout()
  return fig


def plot_rejected(
  records: Sequence[Mapping[str, Any]],
  mismatch: str,
  *,
  seed: int | None = None,
  smooth: int = 1,
) -> Any:
  """Share of response tokens each preset rejects (RS, veto, non-finite)
  under one mismatch. Returns the figure."""
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 3.6))
  plot_metric(
    records,
    'rollout_corr/rejected_token_fraction',
    ax=ax,
    smooth=smooth,
    mismatch=mismatch,
    seed=seed,
  )
  _legend(ax, fontsize=7)
  fig.tight_layout()
  return fig


def plot_final_accuracy(records: Sequence[Mapping[str, Any]]) -> Any:
  """Final eval accuracy of every run, one marker per seed, grouped by
  (mismatch, preset); dashed lines: each seed's `BASELINE` final accuracy,
  dotted: its accuracy after the warm-up. Returns the figure."""
  import matplotlib.pyplot as plt

  groups = list(dict.fromkeys((r['mismatch'], r['preset']) for r in records))
  seeds = sorted({r['seed'] for r in records})
  fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(groups) + 2), 4.2))
  base = baseline_accuracy(records)
  for k, seed in enumerate(seeds):
    color = f'C{k % 10}'
    xs, ys = [], []
    for i, g in enumerate(groups):
      for r in _select(records, mismatch=g[0], preset=g[1], seed=seed):
        if r['summary']['final_accuracy'] is not None:
          xs.append(i)
          ys.append(r['summary']['final_accuracy'])
    ax.plot(xs, ys, 'o', color=color, label=f'seed {seed}')
    if seed in base:
      ax.axhline(
        base[seed], color=color, ls='--', lw=1, label=f'seed {seed}: baseline'
      )
    init = [
      r['summary']['initial_accuracy']
      for r in _select(records, seed=seed, mismatch='none')
    ]
    if init and init[0] is not None:
      ax.axhline(
        init[0], color=color, ls=':', lw=1, label=f'seed {seed}: after SFT'
      )
  ax.set_xticks(range(len(groups)))
  ax.set_xticklabels(
    [f'{p} @ {m}' for m, p in groups], rotation=35, ha='right', fontsize=7
  )
  ax.set_ylabel('final eval accuracy')
  ax.set_ylim(0, 1)
  _legend(ax, fontsize=7)
  ax.grid(axis='y', alpha=0.3)
  fig.tight_layout()
  return fig


def save_plots(records: Sequence[Mapping[str, Any]], out: str) -> list[str]:
  """Writes the grid's plots as PNGs under `out`; returns the paths.

  Curves are drawn per seed (seeds start from different warm-ups, so a mean
  over an uneven set of seeds mixes levels): `baseline_seed<s>.png` (the
  `disabled` preset under every mismatch), `diagnostics_seed<s>.png`,
  `presets_<mismatch>_seed<s>.png` and `rejected_<mismatch>_seed<s>.png`
  (where some preset rejects anything), and `final_accuracy.png`.
  """
  import matplotlib.pyplot as plt

  paths = []

  def save(fig, name):
    path = os.path.join(out, name)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    paths.append(path)

  for seed in sorted({r['seed'] for r in records}):
    mine = _select(records, seed=seed)
    base = _select(mine, preset=BASELINE[0])
    if len({r['mismatch'] for r in base}) > 1:
      save(plot_rewards(mine, preset=BASELINE[0]), f'baseline_seed{seed}.png')
      save(plot_diagnostics(mine), f'diagnostics_seed{seed}.png')
    for m in dict.fromkeys(r['mismatch'] for r in mine):
      here = _select(mine, mismatch=m)
      if len(here) < 2:
        continue
      save(plot_rewards(here, m), f'presets_{m}_seed{seed}.png')
      if any(r['summary']['rejected_token_fraction'] for r in here):
        save(plot_rejected(here, m), f'rejected_{m}_seed{seed}.png')
  save(plot_final_accuracy(records), 'final_accuracy.png')
  return paths
