"""Controlled rollout-mismatch experiments on the embedded arithmetic task.

The correction presets exist because the engine that samples rollouts and
the trainer that scores them disagree. Whether that disagreement hurts, and
which correction helps, is an empirical question; this module answers it on
a task small enough for a laptop CPU by *injecting* a known mismatch into an
otherwise exact engine and training every preset against it:

    python -m jaxcorr.lab --out=docs/mismatch_lab            # the full grid
    python -m jaxcorr.lab --out=/tmp/lab --small             # minutes
    python -m jaxcorr.lab --out=/tmp/lab --presets=disabled,slime_mis \\
        --mismatches=none,stale8 --seeds=0,1 --set=optim.learning_rate=1e-3

Mismatches (`MISMATCHES`, combinable with `+`, e.g. `bf16+stale4`):

* `none`: the engine runs the trainer's fp32 weights (μ = π_old up to
  kernel rounding), the control;
* `bf16`: bf16 engine weights and compute, the usual production gap;
* `int8`: per-row int8 fake-quantised engine weights, a larger but still
  systematic gap;
* `stale<k>` (`stale` = `stale4`): asynchronous rollouts, batch s sampled by
  policy version max(s − k, 0), the gap of off-policy training;
* `severe`: all three at once with k = 8.

Presets are the names of `configs/presets.py` plus `off`
(`correction.enabled=False`: no correction and no diagnostics). The
supervised warm-up does not depend on the preset or the mismatch, so a grid
runs it once per seed (`sft_checkpoint`) and starts every experiment of that
seed from a copy of its checkpoint; the trainer resumes bit-exactly from
it, so a grid run equals a run from scratch.

`summarise` reduces one run's metrics to the numbers a results table needs,
and the `plot_*` helpers draw the curves; the notebooks and the CLI use both.
`small=True` (or `JAXCORR_SMALL=1`) shrinks the runs to a reduced model and
a few dozen steps, so a notebook finishes in a few minutes; its numbers show
that everything runs, not what the full grid finds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import ml_collections

from configs import arith_tiny

# ----------------------------------------------------------- definitions

OFF = 'off'
"""The preset name for `correction.enabled=False` (no correction at all)."""

DEFAULT_STALENESS = 4

MISMATCHES: dict[str, dict[str, Any]] = {
  'none': {},
  'bf16': {'rollout.engine_dtype': 'bfloat16'},
  'int8': {'rollout.engine_quant': 'int8'},
  'stale': {
    'rollout.mode': 'async',
    'rollout.max_staleness': DEFAULT_STALENESS,
  },
  'severe': {
    'rollout.engine_dtype': 'bfloat16',
    'rollout.engine_quant': 'int8',
    'rollout.mode': 'async',
    'rollout.max_staleness': 8,
  },
}
"""Mismatch name -> dotted config overrides; `stale<k>` is parsed."""

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
per batch it trains exactly like `disabled` (tests/test_lab.py checks), it
only logs no diagnostics."""

SMALL_PRESETS = ('disabled', 'decoupled_token_is')
SMALL_MISMATCHES = ('none', 'stale4')

# Shrinks a run for notebooks and tests: a narrower model, an easier task
# (operands up to 19, so 150 warm-up steps reach ~0.8 accuracy), fewer and
# smaller steps. Curves still move, in about 20 s a run after the first.
SMALL: dict[str, Any] = {
  'model.hidden_size': 64,
  'model.intermediate_size': 192,
  'data.max_operand': 19,
  'rollout.prompts_per_step': 16,
  'rollout.max_concurrent_decodes': 128,
  'train.sft_steps': 150,
  'train.sft_batch_size': 64,
  'train.num_steps': 25,
  'train.eval_every': 5,
  'train.eval_prompts': 128,
}

# What every lab run sets: no TensorBoard files, a progress line every 10
# steps, one checkpoint at the end (the lab never resumes mid-run).
LAB: dict[str, Any] = {
  'train.tensorboard': False,
  'train.log_every': 10,
  'train.checkpoint_every': 0,
  'train.keep_checkpoints': 1,
}

# Fields the supervised warm-up reads; two configs that agree on them have
# the same SFT checkpoint. Everything else only matters after step 0.
SFT_FIELDS = (
  'model',
  'data',
  'mesh',
  'rollout.max_prompt_length',
  'rollout.max_new_tokens',
  'train.seed',
  'train.sft_steps',
  'train.sft_batch_size',
  'optim.sft_learning_rate',
  'optim.b1',
  'optim.b2',
  'optim.eps',
  'optim.weight_decay',
  'optim.max_grad_norm',
  'critic.enabled',
  'actor.kl_loss_coef',
  'algorithm.kl_in_reward.enabled',
)

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
)
"""The per-step metrics `run_grid` keeps in results.json."""


def env_small() -> bool:
  """True when `JAXCORR_SMALL` is set to anything but '', '0' or 'false'."""
  v = os.environ.get('JAXCORR_SMALL', '').strip().lower()
  return v not in ('', '0', 'false', 'no')


def mismatch_overrides(name: str) -> dict[str, Any]:
  """Dotted config overrides of mismatch `name`.

  `name` is one of `MISMATCHES`, `stale<k>` (k ≥ 0 policy versions of lag)
  or several joined by `+` (`'bf16+stale4'`); later parts win on conflicts.
  """
  out: dict[str, Any] = {}
  for part in name.split('+'):
    part = part.strip()
    if part in MISMATCHES:
      out.update(MISMATCHES[part])
    elif part.startswith('stale') and part[5:].isdigit():
      out.update(
        {'rollout.mode': 'async', 'rollout.max_staleness': int(part[5:])}
      )
    else:
      raise ValueError(
        f'unknown mismatch {part!r} in {name!r}: use one of '
        f'{", ".join(MISMATCHES)}, stale<k>, or a +-joined combination'
      )
  return out


def _dotted(overrides: Mapping[str, Any]) -> dict[str, Any]:
  """`optim__learning_rate` (a keyword argument) -> `optim.learning_rate`."""
  return {k.replace('__', '.'): v for k, v in overrides.items()}


def _set(config: ml_collections.ConfigDict, path: str, value: Any) -> None:
  """Sets an existing dotted field (the locked config refuses new keys)."""
  *parents, leaf = path.split('.')
  node = config
  for p in parents:
    node = node[p]
  if leaf not in node:
    raise KeyError(f'config has no field {path!r}')
  node[leaf] = value


def _get(config: ml_collections.ConfigDict, path: str) -> Any:
  node = config
  for p in path.split('.'):
    node = node[p]
  return node.to_dict() if isinstance(node, ml_collections.ConfigDict) else node


def make_config(
  preset: str,
  mismatch: str = 'none',
  *,
  seed: int = 0,
  small: bool = False,
  **overrides: Any,
) -> ml_collections.ConfigDict:
  """The locked arithmetic-task config of one experiment.

  Order: the task and `preset` (`configs/arith_tiny.py`'s config string,
  `pulse+` included; `OFF` -> `disabled` with `correction.enabled=False`),
  the seed (`train.seed` and the model's `init_seed`, so seeds differ in
  initialisation as well as data and sampling), `LAB`, `SMALL` if `small`,
  the mismatch, then `overrides` (dotted paths or `section__field`
  keywords).
  """
  pulse, name = arith_tiny.split(preset)
  off = name == OFF
  if off:
    preset = ('pulse+' if pulse else '') + 'disabled'
  config = arith_tiny.get_config(preset)
  if off:
    config.correction.enabled = False
  values = {'train.seed': seed, 'model.init_seed': seed, **LAB}
  if small:
    values.update(SMALL)
  values.update(mismatch_overrides(mismatch))
  values.update(_dotted(overrides))
  for path, value in values.items():
    _set(config, path, value)
  return config


def sft_signature(config: ml_collections.ConfigDict) -> str:
  """A short hash of the fields the warm-up depends on (`SFT_FIELDS`)."""
  fields = {p: _get(config, p) for p in SFT_FIELDS}
  blob = json.dumps(fields, sort_keys=True, default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:12]


# ------------------------------------------------------------ running


def _train(config: ml_collections.ConfigDict, workdir: str, name: str) -> None:
  from jaxcorr.train.loop import Trainer

  trainer = Trainer(config, workdir, config_name=name)
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


def read_rows(workdir: str) -> list[dict[str, Any]]:
  """The rows of `<workdir>/metrics.jsonl`, one per logged step."""
  from jaxcorr.train.metrics import read_metrics

  return read_metrics(os.path.join(workdir, 'metrics.jsonl'))


def _finished(workdir: str, num_steps: int) -> bool:
  """`workdir` holds the metrics of a run that reached `num_steps`."""
  if not os.path.exists(os.path.join(workdir, 'metrics.jsonl')):
    return False
  rows = read_rows(workdir)
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
  small = env_small() if small is None else small
  config = make_config(preset, mismatch, seed=seed, small=small, **overrides)
  if _finished(workdir, config.train.num_steps):
    return read_rows(workdir)
  shutil.rmtree(workdir, ignore_errors=True)
  os.makedirs(workdir)
  if sft_cache is not None:
    shutil.copytree(
      sft_checkpoint(config, sft_cache), os.path.join(workdir, 'checkpoints')
    )
  _train(config, workdir, f'lab:{preset}@{mismatch}/seed{seed}')
  return read_rows(workdir)


# ------------------------------------------------------------ summaries

WALL_FILE = 'lab_wall_s'
"""Where `run_grid` records a run's wall time, for when it is read back."""

COLLAPSE_DROP = 0.2
"""A run collapsed if its final eval accuracy is this far below its peak, or
its last-20% reward this far below its first-20% reward, or any loss is
non-finite."""


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> list[float]:
  return [float(r[key]) for r in rows if key in r and r[key] is not None]


def _mean(xs: Sequence[float]) -> float | None:
  return sum(xs) / len(xs) if xs else None


def summarise(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """One run's numbers from its metrics rows (`run_experiment`'s output).

  Returns:
    steps: RL steps logged; initial/final/peak_accuracy: greedy eval
    accuracy at step 0, at the end and at its best; reward_last20 and
    reward_first20: mean `reward/mean` over the last and first 20 % of the
    RL steps (at least one step); max_kl, mean_kl: of `rollout_corr/kl`;
    max_k3_kl; mean_chi2_token; max_ppl_dev: largest |ppl_ratio − 1|;
    rejected_token_fraction, rejected_seq_fraction: means over steps;
    nonfinite: steps with a non-finite actor loss; collapsed (see
    `COLLAPSE_DROP`). Metrics a run does not log (the `off` preset logs no
    `rollout_corr/`) are None.
  """
  rl = [r for r in rows if 'reward/mean' in r]
  acc = _series(rows, 'eval/accuracy')
  rewards = _series(rl, 'reward/mean')
  n = max(1, math.ceil(0.2 * len(rewards)))
  kl = _series(rl, 'rollout_corr/kl')
  k3 = _series(rl, 'rollout_corr/k3_kl')
  ppl = _series(rl, 'rollout_corr/ppl_ratio')
  losses = _series(rl, 'actor/loss')
  nonfinite = sum(not math.isfinite(x) for x in losses)
  out = {
    'steps': len(rl),
    'initial_accuracy': acc[0] if acc else None,
    'final_accuracy': acc[-1] if acc else None,
    'peak_accuracy': max(acc) if acc else None,
    'reward_first20': _mean(rewards[:n]),
    'reward_last20': _mean(rewards[-n:]),
    'max_kl': max(kl) if kl else None,
    'mean_kl': _mean(kl),
    'max_k3_kl': max(k3) if k3 else None,
    'mean_chi2_token': _mean(_series(rl, 'rollout_corr/chi2_token')),
    'max_ppl_dev': max(abs(x - 1) for x in ppl) if ppl else None,
    'rejected_token_fraction': _mean(
      _series(rl, 'rollout_corr/rejected_token_fraction')
    ),
    'rejected_seq_fraction': _mean(
      _series(rl, 'rollout_corr/rejected_seq_fraction')
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


# ------------------------------------------------------------------ grid


@dataclasses.dataclass
class Grid:
  """Which experiments `run_grid` runs: every preset x mismatch x seed."""

  presets: Sequence[str]
  mismatches: Sequence[str]
  seeds: Sequence[int] = (0,)
  small: bool = False
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def tag(self) -> str:
    """The run-directory prefix: size and a hash of the overrides, so runs
    of other settings are never mistaken for finished runs of these."""
    tag = 'small' if self.small else 'full'
    if self.overrides:
      blob = json.dumps(_dotted(self.overrides), sort_keys=True, default=str)
      tag += '_' + hashlib.sha256(blob.encode()).hexdigest()[:8]
    return tag

  def runs(self) -> list[tuple[str, str, int]]:
    return [
      (p, m, s)
      for s in self.seeds
      for m in self.mismatches
      for p in self.presets
    ]


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
    tag = grid.tag()
    run_dir = os.path.join(
      workdir, tag, f'seed{seed}', mismatch, preset.replace('+', '_')
    )
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
    wall = time.perf_counter() - t0
    if not reused:
      with open(wall_file, 'w') as f:
        f.write(f'{wall:.1f}\n')
    elif os.path.exists(wall_file):
      with open(wall_file) as f:
        wall = float(f.read())
    else:
      wall = None  # finished by someone else, time unknown
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
        'train_s': round(sum(_series(rows, 'time/step')), 1),
      }
    )
    if log is not None:
      log(
        f'[{i}/{len(todo)}] seed={seed} {mismatch:>8s} {preset:30s} '
        f'acc {_fmt(s["initial_accuracy"])} -> '
        f'{_fmt(s["final_accuracy"])}  reward(last20%) '
        f'{_fmt(s["reward_last20"])}  max kl {_fmt(s["max_kl"], 2)}  '
        f'({"?" if wall is None else f"{wall:.0f}"}s'
        f'{", read back" if reused else ""})'
      )
  return records


def enable_compile_cache(path: str) -> None:
  """JAX's persistent compilation cache in `path`, for every program (the
  default thresholds skip the small, quickly compiled ones this task
  has). Takes effect for programs compiled after the call."""
  import jax

  os.makedirs(path, exist_ok=True)
  jax.config.update('jax_compilation_cache_dir', path)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)


# ------------------------------------------------------------ tables


def _fmt(x: float | None, sig: int = 3) -> str:
  if x is None:
    return '–'
  if x != 0 and (abs(x) < 10.0**-sig or abs(x) >= 1e4):
    return f'{x:.{max(sig - 1, 1)}e}'
  return f'{x:.{sig}f}'


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


BASELINE = ('disabled', 'none')
"""(preset, mismatch) of the reference run each seed is compared with."""


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
    '| reward last 20% | max kl | mean χ²_token | max \\|ppl−1\\| '
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
      f'{_fmt(row["peak_accuracy"])} | {_fmt(row["reward_last20"])} | '
      f'{_fmt(row["max_kl"], 2)} | {_fmt(row["mean_chi2_token"], 2)} | '
      f'{_fmt(row["max_ppl_dev"], 2)} | '
      f'{_fmt(row["rejected_token_fraction"], 2)}'
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
        f'{_fmt(s["initial_accuracy"])} | {_fmt(s["final_accuracy"])} | '
        f'{delta} | {cells(s)} | {"yes" if s["collapsed"] else "no"} |'
      )
  else:
    for row in aggregate(records):
      seeds = ', '.join(_fmt(x) for x in row['final_accuracy_per_seed'])
      lines.append(
        f'| {row["mismatch"]} | `{row["preset"]}` | '
        f'{",".join(map(str, row["seeds"]))} | '
        f'{_fmt(row["initial_accuracy"])} | '
        f'{_fmt(row["final_accuracy"])} | ({seeds}) | {cells(row)} | '
        f'{row["collapsed"]}/{len(row["seeds"])} |'
      )
  return '\n'.join(lines) + '\n'


# ------------------------------------------------------------- plots


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
  preset, on
  log axes (the `disabled` preset logs them without changing the update):
  how large each injected mismatch is. Returns the figure."""
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
  with open(os.path.join(out, 'results.md'), 'w') as f:
    f.write('# Mismatch lab results\n\nOne row per run:\n\n')
    f.write(markdown_table(records))
    if any(len(r['seeds']) > 1 for r in aggregate(records)):
      f.write('\nMeans over seeds:\n\n')
      f.write(markdown_table(records, per_seed=False))
  if plots:
    save_plots(records, out)


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
  """The records of a results.json (a file or the directory holding it)."""
  if os.path.isdir(path):
    path = os.path.join(path, 'results.json')
  with open(path) as f:
    return json.load(f)['runs']


# ------------------------------------------------------------------ CLI


def _parse_value(s: str) -> Any:
  try:
    return json.loads(s)
  except json.JSONDecodeError:
    return s


def main(argv: Sequence[str]) -> None:
  import matplotlib
  from absl import app, flags, logging

  f = flags.FLAGS
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')

  matplotlib.use('Agg')
  if not f['verbosity'].present:
    # Orbax logs every save and restore at INFO: 30 lines a run.
    logging.set_verbosity(logging.WARNING)
  small = f.small or env_small()
  overrides = {}
  for item in f.set or ():
    path, _, value = item.partition('=')
    overrides[path] = _parse_value(value)
  plan = default_plan(small)
  if f.presets or f.mismatches or f.seeds:
    plan = [
      Grid(
        tuple(f.presets or PRESETS),
        tuple(f.mismatches or ('none',)),
        tuple(int(s) for s in f.seeds or (0,)),
        small=small,
      )
    ]
  for grid in plan:
    grid.overrides = overrides
  workdir = f.workdir or os.path.join(tempfile.gettempdir(), 'jaxcorr_lab')
  t0 = time.perf_counter()
  records = run_grid(plan, workdir)
  write_results(records, f.out, plan=plan)
  print(markdown_table(records))
  print(f'{len(records)} runs in {time.perf_counter() - t0:.0f}s -> {f.out}')


def _define_flags() -> None:
  from absl import flags

  flags.DEFINE_string(
    'out', None, 'Output directory (results.json, .md, PNGs).'
  )
  flags.DEFINE_string(
    'workdir',
    None,
    'Run directories, shared SFT checkpoints and the compilation cache '
    '(default: $TMPDIR/jaxcorr_lab).',
  )
  flags.DEFINE_bool('small', False, 'Reduced runs (also: JAXCORR_SMALL=1).')
  flags.DEFINE_list(
    'presets', None, 'One grid instead of default_plan: presets (PRESETS).'
  )
  flags.DEFINE_list('mismatches', None, '... its mismatches (none).')
  flags.DEFINE_list('seeds', None, '... its seeds (0).')
  flags.DEFINE_multi_string(
    'set', None, 'A config override, section.field=value (repeatable).'
  )
  flags.mark_flag_as_required('out')


if __name__ == '__main__':
  from absl import app

  _define_flags()
  app.run(main)
