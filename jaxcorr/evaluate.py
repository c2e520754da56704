"""Evaluate a saved checkpoint without training (a thin absl entry, like
`jaxcorr.main`; docs/evaluation.md).

  python -m jaxcorr.evaluate --workdir=/tmp/run              # latest step
  python -m jaxcorr.evaluate --workdir=/tmp/run --step=50 \\
      --set=eval.samples=8 --set=eval.preset=liberal

The run is rebuilt from the workdir's config.json (the config it was
trained with; checkpoints are checked against it on restore), the
checkpoint `--step` (default: the latest) restored read-only, and the eval
harness run once on the restored weights (`jaxcorr.train.evaluation`):
greedy accuracy per eval set and, with `eval.samples` > 0, pass@k / maj@k.
`--set` changes what is measured, never what was trained: only fields of
the `eval` section and `train.eval_prompts`.

The run's config file (the `--config` it was started with, recorded in
its checkpoints) is run first, as `jaxcorr.main` runs it, so rewards and
environments that file registers exist here too; run evaluate from the
directory the run was started in when that path is relative.

Prints the metrics and writes them to `<output_dir>/step_<N>.json`, and
the replies to `<output_dir>/step_<N>.jsonl`
(`jaxcorr.train.evals.samples_log`); `--output_dir` defaults to
`<workdir>/evaluate`. Nothing else in the workdir is written: an
`--output_dir` equal to or inside the run directory (other than its
`evaluate/`) or any other run is refused, and another non-empty directory
needs `--force` (as `jaxcorr.export --out`).

Exit status: 0; 1 with one line `error: ...` when the workdir holds no run
config or no checkpoint (or not `--step`), `--output_dir` is refused, or
the run's config does not build here.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from absl import app, flags

from jaxcorr import console
from jaxcorr.train.evals.checkpoint import evaluate

_WORKDIR = flags.DEFINE_string('workdir', None, 'The run directory.')
_STEP = flags.DEFINE_integer(
  'step', None, 'The checkpoint to evaluate (default: the latest).'
)
_SET = flags.DEFINE_multi_string(
  'set',
  [],
  'section.field=value for an eval.* field or train.eval_prompts, e.g. '
  '--set=eval.samples=8 (repeatable).',
)
_OUTPUT_DIR = flags.DEFINE_string(
  'output_dir', None, 'Where results go (default: <workdir>/evaluate).'
)
_FORCE = flags.DEFINE_bool(
  'force',
  False,
  'Write into a non-empty --output_dir (never into a run directory).',
)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  console.quiet_libraries()
  try:
    step, metrics = evaluate(
      _WORKDIR.value,
      _STEP.value,
      _SET.value,
      _OUTPUT_DIR.value,
      force=_FORCE.value,
    )
  except ValueError as e:
    sys.exit(f'error: {e}')
  print(f'step {step}:')
  for key, value in metrics.items():
    print(f'  {key} = {value:.4g}')


def run() -> None:
  flags.mark_flag_as_required('workdir')
  console.run(main)


if __name__ == '__main__':
  run()
