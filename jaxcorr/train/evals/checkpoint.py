"""Evaluating a saved checkpoint without training: the library behind
`python -m jaxcorr.evaluate` (jaxcorr/evaluate.py, which holds its flags;
docs/evaluation.md).

The run is rebuilt from the workdir's config.json, sections a workdir
saved before they existed taking their defaults; `changes` may touch only
what is measured (the `eval` section and `train.eval_prompts`), never what
was trained.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

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


def evaluate(
  workdir: str,
  step: int | None = None,
  changes: Sequence[str] = (),
  output_dir: str | None = None,
) -> tuple[int, dict[str, float]]:
  """(the step evaluated, its metrics); writes them under `output_dir`
  (module doc)."""
  from etils import epath

  from jaxcorr.train import build
  from jaxcorr.train.evaluation import Evaluator
  from jaxcorr.train.loop import Trainer

  config = load_config(workdir, changes)
  run = build.build(config)
  out = output_dir or f'{workdir}/evaluate'
  trainer = Trainer(
    run, workdir, config=config, read_only=True, allow_config_change=True
  )
  try:
    if trainer.checkpointer.latest_step() is None:
      raise ValueError(f'{workdir} holds no checkpoint')
    if step is not None and step not in trainer.checkpointer.all_steps():
      steps = trainer.checkpointer.all_steps()
      raise ValueError(f'--step={step}: no such checkpoint; saved: {steps}')
    trainer.restore(step)
    harness = trainer.evaluate
    evaluator = Evaluator(
      harness.stage, harness.sets, trainer.engine_params, samples_dir=out
    )
    metrics = evaluator(trainer.step)
  finally:
    trainer.close()
  path = epath.Path(out)
  path.mkdir(parents=True, exist_ok=True)
  record = {'step': trainer.step, **metrics}
  (path / f'step_{trainer.step}.json').write_text(
    json.dumps(record, indent=1) + '\n'
  )
  return trainer.step, metrics
