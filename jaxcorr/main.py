"""The trainer's command line (a thin absl entry; the loop is in
`jaxcorr.train.loop`, docs/architecture.md).

  python -m jaxcorr.main --config=configs/arith_tiny.py --workdir=/tmp/run
  python -m jaxcorr.main --config=configs/gsm8k_qwen.py:decoupled_geo_rs \\
      --config.model.hf_path=/models/Qwen2.5-0.5B-Instruct \\
      --config.data.path=/data/gsm8k/train.jsonl --workdir=gs://bucket/run

`--config` is `file[:config string]`; the config is locked, so a typo in an
override (`--config.train.num_step=5`) fails before anything runs, and
`jaxcorr.train.build.build` validates every field and combination once, at
start-up, before any device work; the `Trainer` takes the result. Re-running with the same `--workdir` resumes from its latest
checkpoint; a changed config is refused unless `--allow_config_change`, and
a second trainer on a workdir in use is refused (`jaxcorr.train.checkpoints.workdir`).
Multi-process runs: see `jaxcorr.distributed` and docs/tpu.md.

Exit status: 0 when `train.num_steps` were run (a re-run of a finished
run prints "nothing to do: step N of N"); 75 (`EXIT_PREEMPTED`) when
SIGTERM or Ctrl-C stopped the run after a checkpoint (re-run to resume);
1 on an error. Config errors (a field's value, an override of a field the
config does not have, a config file that cannot be loaded: printed by
`jaxcorr.console.run`), prompts the run cannot use (too long for
`rollout.max_prompt_length`, or text the tokenizer cannot encode, naming
the file and line: `jaxcorr.data.prompt_check`), a workdir that cannot
hold a run (a file, an unreadable config.json), a device layout the
machine cannot give (`rollout.rollout_devices`, `mesh`), a checkpoint
save on a full disk and an agent environment failing past
`agent.max_env_error_fraction` are one line, `error: ...`, without a
traceback.

The console shows the progress lines and jaxcorr's own logs; the libraries'
INFO logs (orbax's checkpoint lines, ...) only with `--verbose_libs`
(`jaxcorr.console`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from absl import app, flags, logging
from ml_collections import config_flags

from jaxcorr import console

_CONFIG = console.config_file_flag(
  'config',
  'configs/arith_tiny.py',
  'Config file[:config string], e.g. configs/arith_tiny.py:decoupled_geo_rs.',
)
_WORKDIR = flags.DEFINE_string(
  'workdir', None, 'Checkpoints, metrics.jsonl and TensorBoard files.'
)
_ALLOW_CHANGE = flags.DEFINE_bool(
  'allow_config_change',
  False,
  'Resume a workdir whose saved config.json differs from this config.',
)


def _config_name(argv: Sequence[str]) -> str:
  """The `--config` argument as given (recorded in checkpoints)."""
  for arg in argv:
    if arg.startswith('--config='):
      return arg[len('--config=') :]
  return config_flags.get_config_filename(flags.FLAGS['config'])


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  console.quiet_libraries()
  from jaxcorr import distributed
  from jaxcorr.train import build

  try:
    # Before jax.distributed, device or file work: a bad field is a usage
    # error (one line: console.run).
    run = build.build(_CONFIG.value)
    distributed.initialize_from_flags()
    build.check_backend(run)  # the backend may start now
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  from jaxcorr.agents.failures import EnvironmentFailing
  from jaxcorr.data.prompt_check import PromptError
  from jaxcorr.train import preemption, setup
  from jaxcorr.train.checkpoints import workdir
  from jaxcorr.train.checkpoints.disk_full import DiskFull
  from jaxcorr.train.loop import Trainer

  # Errors of the workdir, the machine or the disk: one line, no traceback.
  one_line = (
    workdir.WorkdirUnusable,
    workdir.ConfigUnreadable,
    setup.DeviceLayoutError,
    PromptError,
    DiskFull,
    EnvironmentFailing,
  )
  try:
    trainer = Trainer(
      run,
      _WORKDIR.value,
      config=_CONFIG.value,
      config_name=_config_name(sys.argv),
      allow_config_change=_ALLOW_CHANGE.value,
    )
    last = trainer.train()
  except (workdir.WorkdirBusy, workdir.ConfigChanged) as e:
    raise app.UsageError(str(e)) from e
  except one_line as e:
    sys.exit(f'error: {e}')
  except RuntimeError as e:  # the async modes' producer thread wraps them
    if isinstance(e.__cause__, one_line):
      sys.exit(f'error: {e.__cause__}')
    raise
  keys = ('step', 'reward/mean', 'eval/accuracy')
  if trainer.preempted:
    print(f'preempted: checkpoint at step {trainer.step}; re-run to resume')
    sys.exit(preemption.EXIT_PREEMPTED)
  if not last:  # restored at (or past) train.num_steps: no step ran
    num_steps = trainer.run.train.num_steps
    print(f'nothing to do: step {trainer.step} of {num_steps}')
    return
  logging.info('done: %s', {k: last.get(k) for k in keys if k in last})
  print('done:', ', '.join(f'{k}={last[k]:.4g}' for k in keys if k in last))


def run() -> None:
  flags.mark_flag_as_required('workdir')
  from jaxcorr import distributed

  distributed.define_flags()
  console.run(main)


if __name__ == '__main__':
  run()
