"""Controlled rollout-mismatch experiments on the embedded arithmetic task.

The correction presets exist because the engine that samples rollouts and
the trainer that scores them disagree. Whether that disagreement hurts, and
which correction helps, is an empirical question; this package answers it
on a task small enough for a laptop CPU by *injecting* a known mismatch
into an otherwise exact engine and training every preset against it.
`python -m jaxcorr.lab` runs a grid of experiments from the command line
(`--help` lists the mismatches and the flags).

Mismatches (`MISMATCHES`, combinable with `+`, e.g. `bf16+stale4`): `none`
(the control), `exact` (no gap at all: `rollout.exact`), `bf16` and `int8`
engine weights, `stale<k>` (asynchronous
rollouts k policy versions behind), `inflight<k>` (streaming rollouts with
weights swapped in mid-sequence, no token older than k versions) and
`severe` (bf16 + int8 + stale8); see `mismatch_overrides`. Presets are the names of `configs/presets.py` plus
`off` (`correction.enabled=False`: no correction and no diagnostics). The
supervised warm-up does not depend on the preset or the mismatch, so a grid
runs it once per seed (`sft_checkpoint`) and starts every experiment of that
seed from a copy of its checkpoint; the trainer resumes bit-exactly from
it, so a grid run equals a run from scratch.

`summarise` reduces one run's metrics to the numbers a results table needs,
and the `plot_*` helpers draw the curves; the notebooks and the CLI use both.
`small=True` (or `JAXCORR_SMALL=1`) shrinks the runs to a reduced model and
a few dozen steps, so a notebook finishes in a few minutes; its numbers show
that everything runs, not what the full grid finds.

Modules (everything public is re-exported here, `from jaxcorr import lab`):
  config    mismatches, `make_config` (one experiment's config), SFT keys,
            `Grid` (which experiments a grid runs)
  runs      `run_experiment`, shared warm-ups, `default_plan`,
            `run_grid`
  summary   `summarise` and `curves` of a run, `aggregate` over seeds
  results   the markdown tables, results.json / results.md on disk
  plots     the matplotlib figures and `save_plots`
  exact     the exact-mode cell (`python -m jaxcorr.lab.exact`): what
            correction is left when μ equals π_old bit for bit (not
            re-exported: `from jaxcorr.lab import exact`)
  __main__  the command line
"""

from jaxcorr.lab.config import (
  DEFAULT_STALENESS,
  INFLIGHT_DECODE_CHUNK,
  LAB,
  MISMATCHES,
  OFF,
  SFT_FIELDS,
  SMALL,
  Grid,
  env_small,
  inflight_overrides,
  make_config,
  mismatch_overrides,
  sft_signature,
  stale_overrides,
)
from jaxcorr.lab.plots import (
  DIAGNOSTICS,
  plot_diagnostics,
  plot_final_accuracy,
  plot_metric,
  plot_rejected,
  plot_rewards,
  save_plots,
)
from jaxcorr.lab.results import (
  load_results,
  markdown_table,
  spread_table,
  write_results,
  write_tables,
)
from jaxcorr.lab.runs import (
  PRESETS,
  SMALL_MISMATCHES,
  SMALL_PRESETS,
  WALL_FILE,
  default_plan,
  enable_compile_cache,
  run_directory,
  run_experiment,
  run_grid,
  sft_checkpoint,
)
from jaxcorr.lab.summary import (
  BASELINE,
  COLLAPSE_DROP,
  CURVE_KEYS,
  aggregate,
  baseline_accuracy,
  curves,
  summarise,
)

__all__ = [
  'BASELINE',
  'COLLAPSE_DROP',
  'CURVE_KEYS',
  'DEFAULT_STALENESS',
  'DIAGNOSTICS',
  'INFLIGHT_DECODE_CHUNK',
  'LAB',
  'MISMATCHES',
  'OFF',
  'PRESETS',
  'SFT_FIELDS',
  'SMALL',
  'SMALL_MISMATCHES',
  'SMALL_PRESETS',
  'WALL_FILE',
  'Grid',
  'aggregate',
  'baseline_accuracy',
  'curves',
  'default_plan',
  'enable_compile_cache',
  'env_small',
  'inflight_overrides',
  'load_results',
  'make_config',
  'markdown_table',
  'mismatch_overrides',
  'plot_diagnostics',
  'plot_final_accuracy',
  'plot_metric',
  'plot_rejected',
  'plot_rewards',
  'run_directory',
  'run_experiment',
  'run_grid',
  'save_plots',
  'sft_checkpoint',
  'sft_signature',
  'spread_table',
  'stale_overrides',
  'summarise',
  'write_results',
  'write_tables',
]
