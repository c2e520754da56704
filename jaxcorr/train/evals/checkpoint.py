"""Evaluating a saved checkpoint without training: the library behind
`python -m jaxcorr.evaluate` (jaxcorr/evaluate.py, which holds its flags;
docs/evaluation.md).

The run is rebuilt from the workdir's config.json, sections a workdir
saved before they existed taking their defaults; `changes` may touch only
what is measured (the `eval` section and `train.eval_prompts`), never what
was trained. The run's config file (the `--config` recorded in its
checkpoints) is run first, as `jaxcorr.main` runs it, so that rewards and
environments it registers exist (`load_config_module`). The output
directory is checked like `jaxcorr.export`'s `--out`
(`workdir.check_output_dir`): never inside the run's records or another
run's; `<workdir>/evaluate` (the default) always; another non-empty
directory only with `force`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from jaxcorr.train.checkpoints.workdir import CHECKPOINT_DIR, check_output_dir

OUTPUT_DIRNAME = 'evaluate'  # <workdir>/evaluate: the default --output_dir
_CHANGEABLE_SECTIONS = ('eval',)
_CHANGEABLE_FIELDS = ('train.eval_prompts',)


def _parse(text: str, like: object) -> object:
  """`text` as the type of the field's current value."""
  if isinstance(like, bool):
    if text.lower() not in ('true', 'false'):
      raise ValueError(f'{text!r} is not True or False')
    return text.lower() == 'true'
  if isinstance(like, int):
    return int(text)
  if isinstance(like, float):
    return float(text)
  return text


def load_config(workdir: str, changes: Sequence[str]) -> object:
  """The run's ConfigDict from `<workdir>/config.json` (sections a workdir
  saved before them lack at their defaults), with `changes` applied.

  Raises:
    ValueError: no config.json, or a change outside the eval fields.
  """
  import ml_collections

  from jaxcorr.config import convert
  from jaxcorr.train import build
  from jaxcorr.train.checkpoints import workdir as workdir_lib

  saved = workdir_lib.read_config(workdir)
  if saved is None:
    raise ValueError(f'{workdir} holds no {workdir_lib.CONFIG_FILE}')
  for name, cls in build.SECTIONS.items():
    section = convert.section(cls).to_dict()
    section.update(saved.get(name, {}))
    saved[name] = section
  config = ml_collections.ConfigDict(saved)
  for change in changes:
    key, sep, value = change.partition('=')
    section, _, field = key.partition('.')
    if not sep or (
      section not in _CHANGEABLE_SECTIONS and key not in _CHANGEABLE_FIELDS
    ):
      raise ValueError(
        f'--set={change}: allowed: eval.<field>=value or '
        'train.eval_prompts=value (what is measured, not what was trained)'
      )
    if field not in config[section]:
      allowed = ', '.join(config[section].keys())
      raise ValueError(f'--set={change}: no field {key}; allowed: {allowed}')
    config[section][field] = _parse(value, config[section][field])
  return config


def _checkpoint(workdir: str, step: int | None) -> tuple[int, str]:
  """(the step to evaluate, the config string its checkpoint records: the
  `--config` `jaxcorr.main` was given); read before anything is built."""
  from jaxcorr import console
  from jaxcorr.train.checkpoints import checkpointer

  # Orbax warns that a read-only directory is read-only: what was asked.
  with (
    console.dropped_library_errors('is read only'),
    checkpointer.Checkpointer(
      f'{workdir}/{CHECKPOINT_DIR}', every=0, keep=1, read_only=True
    ) as ckpt,
  ):
    steps = ckpt.all_steps()
    if not steps:
      raise ValueError(f'{workdir} holds no checkpoint')
    if step is not None and step not in steps:
      raise ValueError(f'--step={step}: no such checkpoint; saved: {steps}')
    step = steps[-1] if step is None else step
    try:
      name = ckpt.meta(step).get('config') or ''
    except Exception:  # an unreadable step: the restore reports it
      name = ''
  return step, name


def load_config_module(name: str) -> str:
  """Runs the run's config file as `jaxcorr.main` did (`name`: its
  `--config`, `file.py[:config string]`), so that the rewards and
  environments it registers exist; its config is not used (config.json
  is the run's). A name that is no `.py` file (a test's, the lab's) runs
  nothing. Returns '' or, when the file is not found from here, a note
  saying so."""
  from ml_collections.config_flags import config_flags

  path = name.partition(':')[0]
  if not path.endswith('.py'):
    return ''
  if not os.path.isfile(path):
    return (
      f"the run's config file {path} (recorded in its checkpoint), which "
      'may register it, is not found from here: run evaluate in the '
      'directory the run was started from'
    )
  config_flags.ConfigFileFlagParser('config').parse(name)
  return ''


@dataclasses.dataclass(frozen=True)
class Plan:
  """What `evaluate` will do, every input checked (`plan`)."""

  config: Any  # the run's ConfigDict, the changes applied
  run: Any  # its validated RunConfig
  step: int  # the checkpoint to evaluate
  out: str  # the output directory


def plan(
  workdir: str,
  step: int | None = None,
  changes: Sequence[str] = (),
  output_dir: str | None = None,
  *,
  force: bool = False,
) -> Plan:
  """Every check of `evaluate` (the config and its changes, the output
  directory, the checkpoint, the run's components after its config file
  ran), before any device work; ValueError naming what is wrong."""
  from jaxcorr.train import build

  config = load_config(workdir, changes)
  own = f'{workdir}/{OUTPUT_DIRNAME}'
  out = output_dir or own
  check_output_dir(
    workdir,
    out,
    flag='--output_dir',
    writes="its step_<N>.json / .jsonl there would replace the run's own "
    'records',
    force=force,
    own=own,
  )
  step, config_name = _checkpoint(workdir, step)
  missing = load_config_module(config_name)
  try:
    run = build.build(config)
  except ValueError as e:
    raise ValueError(f'{e} ({missing})' if missing else str(e)) from None
  return Plan(config, run, step, out)


def evaluate(
  workdir: str,
  step: int | None = None,
  changes: Sequence[str] = (),
  output_dir: str | None = None,
  *,
  force: bool = False,
) -> tuple[int, dict[str, float]]:
  """(the step evaluated, its metrics); writes them under `output_dir`
  (module doc; every input checked first: `plan`)."""
  from etils import epath

  from jaxcorr.train.evaluation import Evaluator
  from jaxcorr.train.loop import Trainer

  p = plan(workdir, step, changes, output_dir, force=force)
  trainer = Trainer(
    p.run, workdir, config=p.config, read_only=True, allow_config_change=True
  )
  try:
    trainer.restore(p.step)
    harness = trainer.evaluate
    evaluator = Evaluator(
      harness.stage, harness.sets, trainer.engine_params, samples_dir=p.out
    )
    metrics = evaluator(trainer.step)
  finally:
    trainer.close()
  path = epath.Path(p.out)
  path.mkdir(parents=True, exist_ok=True)
  record = {'step': trainer.step, **metrics}
  (path / f'step_{trainer.step}.json').write_text(
    json.dumps(record, indent=1) + '\n'
  )
  return trainer.step, metrics
