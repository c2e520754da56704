"""Running experiments: one preset against one mismatch (`run_experiment`),
or a plan of grids of them (`run_grid`) sharing one warm-up per seed.

The supervised warm-up does not depend on the preset or the mismatch, so a
grid runs it once per seed (`sft_checkpoint`) and starts every experiment
of that seed from a copy of its checkpoint; the trainer resumes bit-exactly
from it, so a grid run equals a run from scratch.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections

from jaxcorr.lab.config import (
  Grid,
  env_small,
  make_config,
  sft_signature,
)
from jaxcorr.lab.results import fmt
from jaxcorr.lab.summary import curves, series, summarise

PRESETS = (
  'disabled',
  'decoupled_token_is',
  'decoupled_seq_is_rs',
  'decoupled_geo_rs',
  'bypass_pg_is',
  'slime_mis',
  'prime_dppo_kl',
  'decoupled_token_is+rollout_kl',
)
"""The presets the full grid compares. `OFF` is left out: with one update
per batch it trains exactly like `disabled` (tests/lab/test_lab.py checks), it
only logs no diagnostics."""

SMALL_PRESETS = ('disabled', 'decoupled_token_is')
SMALL_MISMATCHES = ('none', 'stale4')

WALL_FILE = 'lab_wall_s'
"""Where `run_grid` records a run's wall time, for when it is read back."""

# ---------------------------------------------------------- one experiment


def _train(
  config: ml_collections.ConfigDict,
  workdir: str,
  name: str,
  *,
  shared_sft: bool = False,
) -> None:
  """Trains `workdir` to the end. `shared_sft`: its checkpoint 0 is a copy
  of a warm-up shared by every config of one SFT signature, saved with
  another config's RL settings, which the restore's config check must
  accept."""
  from jaxcorr.train.loop import Trainer

  trainer = Trainer.from_config(
    config, workdir, config_name=name, allow_config_change=shared_sft
  )
  try:
    trainer.train()
  finally:
    trainer.close()


def sft_checkpoint(config: ml_collections.ConfigDict, cache_dir: str) -> str:
  """The warm-up checkpoint directory for `config`, trained on first use.

  Runs the trainer with `train.num_steps=0`, which does the SFT warm-up,
  saves checkpoint 0 and stops. The directory is keyed by `sft_signature`,
  so every experiment whose warm-up would be identical shares it.
  """
  sig = sft_signature(config)
  workdir = os.path.join(cache_dir, f'sft_{sig}')
  ckpt = os.path.join(workdir, 'checkpoints')
  done = os.path.join(workdir, 'DONE')
  if os.path.exists(done):
    return ckpt
  shutil.rmtree(workdir, ignore_errors=True)
  sft = ml_collections.ConfigDict(config.to_dict())
  sft.train.num_steps = 0
  sft.train.eval_every = 0
  sft.lock()
  _train(sft, workdir, f'lab-sft-{sig}')
  if not os.path.isdir(os.path.join(ckpt, '0')):
    raise RuntimeError(
      f'the SFT run in {workdir} saved no checkpoint 0 (num_steps=0 should '
      'save it and stop)'
    )
  with open(done, 'w') as f:
    f.write(sig + '\n')
  return ckpt


def _finished(workdir: str, num_steps: int) -> bool:
  """`workdir` holds the metrics of a run that reached `num_steps`."""
  if not os.path.exists(os.path.join(workdir, 'metrics.jsonl')):
    return False
  from jaxcorr.train.tracker.metrics import read_metrics

  rows = read_metrics(workdir)
  return bool(rows) and rows[-1].get('step') == num_steps


def run_experiment(
  preset: str,
  mismatch: str = 'none',
  *,
  seed: int = 0,
  workdir: str,
  small: bool | None = None,
  sft_cache: str | None = None,
  **overrides: Any,
) -> list[dict[str, Any]]:
  """Train one preset against one mismatch; returns the metrics rows.

  Args:
    preset: a `configs/presets.py` name, `+rollout_kl` forms included, or
      `OFF`.
    mismatch: see `mismatch_overrides`.
    seed: `train.seed` and `model.init_seed`.
    workdir: a fresh directory for this run (metrics.jsonl, checkpoints).
      A directory whose metrics already reach the last step is not rerun.
    small: `SMALL` sizes; None reads `JAXCORR_SMALL`.
    sft_cache: where warm-up checkpoints are shared (`sft_checkpoint`);
      None runs the warm-up inside this run.
    **overrides: further config values, `section__field=value` or, via
      `**{'section.field': value}`, dotted.
  """
  from jaxcorr.train.tracker.metrics import read_metrics

  small = env_small() if small is None else small
  config = make_config(preset, mismatch, seed=seed, small=small, **overrides)
  if _finished(workdir, config.train.num_steps):
    return read_metrics(workdir)
  shutil.rmtree(workdir, ignore_errors=True)
  os.makedirs(workdir)
  if sft_cache is not None:
    shutil.copytree(
      sft_checkpoint(config, sft_cache), os.path.join(workdir, 'checkpoints')
    )
  name = f'lab:{preset}@{mismatch}/seed{seed}'
  _train(config, workdir, name, shared_sft=sft_cache is not None)
  return read_metrics(workdir)


# ------------------------------------------------------------------ grid


def default_plan(small: bool | None = None) -> list[Grid]:
  """The CLI's default experiments (docs/mismatch_lab.md explains them).

  Full, 17 runs (~35 min on 2 CPU cores): the uncorrected baseline
  (`disabled`) under every mismatch, every correcting preset under the
  mismatch that breaks the baseline (`stale4`), geo-RS under bf16 (its
  band is narrower than a bf16 engine's gap), and a second seed for the
  three runs the conclusions lean on most. Small: two presets under no
  mismatch and under staleness, one seed.
  """
  small = env_small() if small is None else small
  if small:
    return [Grid(SMALL_PRESETS, SMALL_MISMATCHES, (0,), small=True)]
  return [
    Grid(
      ('disabled',),
      ('none', 'bf16', 'int8', 'stale1', 'stale4', 'severe'),
      (0,),
    ),
    Grid(PRESETS, ('stale4',), (0,)),
    Grid(('decoupled_geo_rs',), ('bf16',), (0,)),
    Grid(('disabled',), ('none',), (1,)),
    Grid(('disabled', 'decoupled_token_is'), ('stale4',), (1,)),
  ]


def run_grid(
  plan: Grid | Sequence[Grid],
  workdir: str,
  *,
  log: Callable[[str], None] | None = print,
  keep_checkpoints: bool = False,
  compile_cache: bool = True,
) -> list[dict[str, Any]]:
  """Runs every experiment of `plan` (one grid or several; a run in two
  grids runs once) under `workdir`, sharing one warm-up checkpoint per
  seed; returns one record per run: preset, mismatch, seed, `summary`,
  `curves`, `wall_s` (the run, its share of warm-up included) and
  `train_s` (the sum of its RL steps' `time/step`).

  Runs whose metrics are complete are read back instead of rerun, so an
  interrupted grid continues where it stopped. Checkpoints are deleted
  after each run unless `keep_checkpoints`. `compile_cache` turns on JAX's
  persistent compilation cache under `workdir`: every run compiles the same
  programs, and reading them back saves ~15 s a run on a CPU.
  """
  plan = [plan] if isinstance(plan, Grid) else list(plan)
  if compile_cache:
    enable_compile_cache(os.path.join(workdir, 'jax_cache'))
  todo: dict[tuple[str, str, int], Grid] = {}
  for grid in plan:
    for key in grid.runs():
      todo.setdefault(key, grid)
  records = []
  for i, ((preset, mismatch, seed), grid) in enumerate(todo.items(), 1):
    run_dir = run_directory(workdir, grid, preset, mismatch, seed)
    wall_file = os.path.join(run_dir, WALL_FILE)
    config = make_config(
      preset, mismatch, seed=seed, small=grid.small, **grid.overrides
    )
    reused = _finished(run_dir, config.train.num_steps)
    t0 = time.perf_counter()
    rows = run_experiment(
      preset,
      mismatch,
      seed=seed,
      workdir=run_dir,
      small=grid.small,
      sft_cache=os.path.join(workdir, 'sft'),
      **grid.overrides,
    )
    wall = _wall_time(wall_file, time.perf_counter() - t0, reused)
    if not keep_checkpoints:
      shutil.rmtree(os.path.join(run_dir, 'checkpoints'), True)
    s = summarise(rows)
    records.append(
      {
        'preset': preset,
        'mismatch': mismatch,
        'seed': seed,
        'summary': s,
        'curves': curves(rows),
        'wall_s': None if wall is None else round(wall, 1),
        'train_s': round(sum(series(rows, 'time/step')), 1),
      }
    )
    if log is not None:
      log(
        f'[{i}/{len(todo)}] seed={seed} {mismatch:>8s} {preset:30s} '
        f'acc {fmt(s["initial_accuracy"])} -> '
        f'{fmt(s["final_accuracy"])}  reward(last20%) '
        f'{fmt(s["reward_last20"])}  max k3 {fmt(s["max_k3_kl"], 2)}  '
        f'({"?" if wall is None else f"{wall:.0f}"}s'
        f'{", read back" if reused else ""})'
      )
  return records


def run_directory(
  workdir: str, grid: Grid, preset: str, mismatch: str, seed: int
) -> str:
  """Where `run_grid` trains one run of `grid` under `workdir`."""
  return os.path.join(
    workdir, grid.tag(), f'seed{seed}', mismatch, preset.replace('+', '_')
  )


def _wall_time(path: str, measured: float, reused: bool) -> float | None:
  """A run's wall time: the one `measured` now, recorded in `path`, or for
  a run read back the one recorded when it ran (None: unknown)."""
  if not reused:
    with open(path, 'w') as f:
      f.write(f'{measured:.1f}\n')
    return measured
  if os.path.exists(path):
    with open(path) as f:
      return float(f.read())
  return None  # finished by someone else, time unknown


def enable_compile_cache(path: str) -> None:
  """JAX's persistent compilation cache in `path`, for every program (the
  default thresholds skip the small, quickly compiled ones this task
  has). Takes effect for programs compiled after the call."""
  import jax

  os.makedirs(path, exist_ok=True)
  jax.config.update('jax_compilation_cache_dir', path)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
