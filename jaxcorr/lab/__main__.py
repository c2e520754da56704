"""Controlled rollout-mismatch experiments on the embedded arithmetic task.

The correction presets exist because the engine that samples rollouts and
the trainer that scores them disagree. Whether that disagreement hurts, and
which correction helps, is an empirical question; the lab answers it on
a task small enough for a laptop CPU by *injecting* a known mismatch into an
otherwise exact engine and training every preset against it:

    python -m jaxcorr.lab --out=docs/mismatch_lab            # the full grid
    python -m jaxcorr.lab --out=/tmp/lab --small             # minutes
    python -m jaxcorr.lab --out=/tmp/lab --presets=disabled,slime_mis \\
        --mismatches=none,stale8 --seeds=0,1 --set=optim.learning_rate=1e-3

Mismatches (`MISMATCHES`, combinable with `+`, e.g. `bf16+stale4`):

* `none`: the engine runs the trainer's fp32 weights (μ = π_old up to
  kernel rounding), the control;
* `exact`: `rollout.exact`, μ = π_old bit for bit (no gap at all;
  `exact+stale<k>` leaves staleness alone; `python -m jaxcorr.lab.exact`
  runs the exact-mode cell, docs/mismatch_lab.md);
* `bf16`: bf16 engine weights and compute, the usual production gap;
* `int8`: per-row int8 fake-quantised engine weights, a larger but still
  systematic gap;
* `stale<k>` (`stale` = `stale4`): asynchronous rollouts, batch s sampled by
  policy version max(s − k, 0), the gap of off-policy training;
* `inflight<k>`: streaming rollouts, weights swapped into the engine
  between decode chunks while rows are in flight (one response can mix
  versions), no token older than k versions;
* `w_int8`, `w_fp8`, `kv_int8`: a bf16 engine with int8 / fp8 weights
  stored narrow, or an int8 KV cache (`rollout.quantization`,
  `rollout.kv_cache_dtype`: docs/precision.md); `w_int8_matched`: int8
  weights with π_old from the same quantized weights;
* `severe`: all three at once with k = 8.

Presets are the names of `configs/presets.py` plus `off`
(`correction.enabled=False`: no correction and no diagnostics). Without
--presets, --mismatches or --seeds the CLI runs `default_plan`; it writes
results.json, results.md and the PNGs to --out and prints the table;
--tables_only rewrites --out's results.md from its results.json, running
nothing (tables of an earlier grid in today's columns).
--small (or `JAXCORR_SMALL=1`) shrinks the runs to a reduced model and a
few dozen steps; their numbers show that everything runs, not what the
full grid finds.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from jaxcorr import console
from jaxcorr.lab.config import Grid, env_small
from jaxcorr.lab.results import (
  load_results,
  markdown_table,
  write_results,
  write_tables,
)
from jaxcorr.lab.runs import PRESETS, default_plan, run_grid


def _parse_value(s: str) -> Any:
  try:
    return json.loads(s)
  except json.JSONDecodeError:
    return s


def main(argv: Sequence[str]) -> None:
  import matplotlib
  from absl import app, flags

  f = flags.FLAGS
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')

  matplotlib.use('Agg')
  # Orbax logs every save and restore at INFO: 30 lines a run.
  console.quiet_libraries()
  if f.tables_only:  # results.md again from the stored records
    write_tables(load_results(f.out), f.out)
    print(f'{os.path.join(f.out, "results.md")} rewritten from results.json')
    return
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
  flags.DEFINE_bool(
    'tables_only',
    False,
    "Run nothing: rewrite --out's results.md from its results.json.",
  )
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
  _define_flags()
  console.run(main)
