"""The exact-mode cell (issue 39 item 5): what correction is left to do
when the engine's μ equals the trainer's π_old bit for bit
(`rollout.exact`, docs/rollout.md "Exact mode").

    python -m jaxcorr.lab.exact --out=docs/mismatch_lab/exact \\
        --workdir=/tmp/jaxcorr_lab

runs `plan()` (small runs, `SMALL` sizes with one eval at the start and one
at the end), then writes results.json, results.md and the PNGs as the lab's
CLI does, and `TABLE` (docs/mismatch_lab/exact/exact.md): for every
(mismatch, seed), whether each preset's
final params equal the uncorrected (`off`) run's bit for bit (a SHA-256 of
the params and max |θ − θ_off|), and the `rollout_corr/` gap over the
steps whose rows were sampled by the trainer's own version (staleness 0)
and over the others. Finished runs are read back, so the command
regenerates the tables without training again.

The grids: at staleness 0 (`exact`) the uncorrected run and four
correction presets that reweight, clip, mask or reject by π_old / μ
(`EQUAL_PRESETS`) and one that adds a KL term to μ; with a fixed lag of
k = 1, 2 (`exact+stale<k>`) no correction against token IS; and the
non-exact sync run (`disabled` under `none`) as the control whose gap exact
mode removes. 3 seeds each.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

from jaxcorr.lab.config import OFF, Grid
from jaxcorr.lab.results import fmt, write_results
from jaxcorr.lab.runs import run_directory, run_grid

SEEDS = (0, 1, 2)
EQUAL_PRESETS = (
  OFF,
  'decoupled_token_is',
  'slime_mis',
  'bypass_ppo_clip',
  'decoupled_token_is+rollout_kl',
)
"""Staleness 0: `off` (no correction) and presets that should all train
like it when every weight π_old / μ is exactly 1; `+rollout_kl` adds
k2(π_θ, μ), which is not a function of that weight (docs/mismatch_lab.md)."""
STALE_PRESETS = (OFF, 'decoupled_token_is')
STALE = ('exact+stale1', 'exact+stale2')
CELL_SET: dict[str, Any] = {'train.eval_every': 25}
"""On top of `SMALL` (25 RL steps): eval at the first and last step only."""

TABLE = 'exact.md'
"""The cell's own table, beside results.md in --out."""
FILE = 'exact_cell.json'
"""A run's params digest and gap, beside its metrics (read back)."""

# The `rollout_corr/` metrics that compare π_old with μ, and their value
# when the two are equal.
GAP_METRICS = {
  'kl': 0.0,
  'k3_kl': 0.0,
  'chi2_token': 0.0,
  'chi2_seq': 0.0,
  'log_ppl_abs_diff': 0.0,
  'ppl_ratio': 1.0,
  'rollout_is_max': 1.0,
  'rollout_is_min': 1.0,
  'rejected_token_fraction': 0.0,
  'rejected_seq_fraction': 0.0,
}


def plan() -> list[Grid]:
  """The cell's grids (module docstring)."""
  kw = dict(small=True, overrides=dict(CELL_SET))
  return [
    Grid(EQUAL_PRESETS, ('exact',), SEEDS, **kw),
    Grid(STALE_PRESETS, STALE, SEEDS, **kw),
    Grid(('disabled',), ('none',), SEEDS, **kw),
  ]


def final_params(run_dir: str) -> dict[str, Any]:
  """{path: numpy array} of the params of `run_dir`'s newest checkpoint."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  root = os.path.join(run_dir, 'checkpoints')
  step = max(int(s) for s in os.listdir(root) if s.isdigit())
  tree = ocp.PyTreeCheckpointer().restore(
    os.path.join(root, str(step), 'state')
  )
  leaves = jax.tree_util.tree_leaves_with_path(tree['state']['params'])
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}


def digest(params: Mapping[str, Any]) -> str:
  """SHA-256 of every param's path, dtype, shape and bytes."""
  h = hashlib.sha256()
  for path in sorted(params):
    v = params[path]
    h.update(f'{path}:{v.dtype}:{v.shape}'.encode())
    h.update(v.tobytes())
  return h.hexdigest()


def gap(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """max |metric − its value at μ = π_old| over `GAP_METRICS` and the
  steps whose rows all came from the trainer's version (`fresh`), the same
  over the other steps (`stale`, None if none) and their mean k3 KL;
  None throughout for a run without diagnostics."""
  out: dict[str, Any] = {'fresh': None, 'stale': None, 'stale_k3': None}
  k3 = []
  for r in rows:
    if 'rollout_corr/kl' not in r:
      continue
    dev = max(
      abs(r[f'rollout_corr/{k}'] - v)
      for k, v in GAP_METRICS.items()
      if f'rollout_corr/{k}' in r  # IS and RS metrics: with IS / RS only
    )
    key = 'stale' if r.get('rollout/staleness_max', 0) > 0 else 'fresh'
    out[key] = max(dev, out[key] or 0.0)
    if key == 'stale':
      k3.append(r['rollout_corr/k3_kl'])
  if k3:
    out['stale_k3'] = sum(k3) / len(k3)
  return out


def _measure(
  workdir: str, records: Sequence[dict[str, Any]], grids: Sequence[Grid]
) -> None:
  """Adds `exact` (digest, max |θ − θ_ref|, gap) to each record, from its
  run's checkpoint (then deleted) or from FILE; ref is the same (mismatch,
  seed)'s `off` run, else the record itself."""
  from jaxcorr.train.tracker.metrics import read_metrics

  where = {key: g for g in grids for key in g.runs()}
  cache: dict[str, Any] = {}

  def params(key):
    d = run_directory(workdir, where[key], *key)
    if d not in cache:
      cache[d] = final_params(d)
    return cache[d]

  for r in records:
    key = (r['preset'], r['mismatch'], r['seed'])
    d = run_directory(workdir, where[key], *key)
    path = os.path.join(d, FILE)
    if not os.path.exists(path):
      ref = (OFF, r['mismatch'], r['seed'])
      ref = ref if ref in where else key
      mine, theirs = params(key), params(ref)
      diff = max(float(abs(mine[p] - theirs[p]).max()) for p in mine)
      out = dict(sha256=digest(mine), ref=ref[0], max_abs_diff=diff)
      out.update(gap(read_metrics(d)))
      with open(path + '.tmp', 'w') as f:
        json.dump(out, f)
      os.replace(path + '.tmp', path)
    with open(path) as f:
      r['exact'] = json.load(f)
  for r in records:
    key = (r['preset'], r['mismatch'], r['seed'])
    shutil.rmtree(
      os.path.join(run_directory(workdir, where[key], *key), 'checkpoints'),
      ignore_errors=True,
    )


def equality_table(records: Sequence[Mapping[str, Any]]) -> str:
  """One row per (mismatch, seed, preset): params digest, = ref or the
  largest param difference, the gap at staleness 0 and after."""
  lines = [
    '| mismatch | seed | preset | params sha256 | vs `off` | gap, fresh '
    'steps | gap, stale steps | mean k3, stale steps | final acc |',
    '|' + '---|' * 9,
  ]
  for r in sorted(records, key=lambda r: (r['mismatch'], r['seed'])):
    e = r['exact']
    same = 'itself' if e['ref'] == r['preset'] else '≠'
    if same == '≠' and e['max_abs_diff'] == 0.0:
      same = '**= bit for bit**'
    elif same == '≠':
      same = f'max \\|Δθ\\| {fmt(e["max_abs_diff"], 2)}'
    lines.append(
      f'| {r["mismatch"]} | {r["seed"]} | `{r["preset"]}` | '
      f'`{e["sha256"][:12]}` | {same} | {fmt(e["fresh"], 2)} | '
      f'{fmt(e["stale"], 2)} | {fmt(e["stale_k3"], 2)} | '
      f'{fmt(r["summary"]["final_accuracy"])} |'
    )
  return '\n'.join(lines) + '\n'


def run_cell(out: str, workdir: str) -> list[dict[str, Any]]:
  """Runs (or reads back) the cell, writes `out` (module docstring)."""
  grids = plan()
  records = run_grid(grids, workdir, keep_checkpoints=True)
  _measure(workdir, records, grids)
  write_results(records, out, plan=grids)
  path = os.path.join(out, TABLE)
  with open(path + '.tmp', 'w') as f:
    f.write('# Exact-mode cell\n\n' + equality_table(records))
  os.replace(path + '.tmp', path)
  return records


def main(argv: Sequence[str]) -> None:
  import matplotlib
  from absl import app, flags

  from jaxcorr import console

  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  matplotlib.use('Agg')
  console.quiet_libraries()
  f = flags.FLAGS
  records = run_cell(f.out, f.workdir)
  print(equality_table(records))


if __name__ == '__main__':
  from absl import flags

  flags.DEFINE_string('out', None, 'Output directory.')
  flags.DEFINE_string('workdir', '/tmp/jaxcorr_lab', 'Run directories.')
  flags.mark_flag_as_required('out')
  from jaxcorr import console

  console.run(main)
