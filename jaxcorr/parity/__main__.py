"""Engine vs trainer log-prob parity, per setting (docs/parity.md).

    python -m jaxcorr.parity                                 # tiny, fp32
    python -m jaxcorr.parity --settings=fp32,bf16,int8 \\
        --config=configs/smollm2_arith.py --prompts=4
    python -m jaxcorr.parity --all --out=docs/parity          # the docs

For each setting (`jaxcorr.parity.settings.SETTINGS`: config overrides,
or a config of its own for MoE and multi-turn) one batch of prompts goes
through the run's real engine and the trainer's π_old on the same tokens
(`jaxcorr.parity.measure`), and one table row of retention bands, max
|Δ log p|, k3, bit-equality and argmax agreement is printed
(`jaxcorr.parity.bands`). --out also writes results.json, results.md and
parity.png. --all runs the docs plan: every setting on SmolLM2-135M where
it applies and the converted checkpoint exists (`make smollm2`), on the
tiny model of its config otherwise; --config and --settings do not apply.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import ml_collections

from jaxcorr import console
from jaxcorr.parity import report
from jaxcorr.parity import settings as settings_lib
from jaxcorr.parity.settings import SMOLLM2, TINY, Setting

DOCS_TINY = (('train.sft_steps', 100), ('rollout.prompts_per_step', 8))
"""The docs plan's tiny models: a short SFT warm-up (a from-scratch model
is near uniform), 8 prompts."""
DOCS_SMOLLM2 = (('rollout.prompts_per_step', 4),)
"""The docs plan's SmolLM2 rows: 4 prompts x 4 samples x 16 tokens."""


def _with(config: ml_collections.ConfigDict, pairs) -> Any:
  return settings_lib.apply(Setting('plan', '', tuple(pairs)), config)


def smollm2_available() -> bool:
  from jaxcorr.model import smollm2

  folder = smollm2.default_dir()
  return os.path.isfile(os.path.join(folder, 'tokenizer_config.json'))


def docs_plan() -> list[tuple[Setting, str, Any]]:
  """(setting, model label, ConfigDict) of `--all` (module docstring),
  the tiny models' rows first."""
  smol = smollm2_available()
  plan = []
  for s in settings_lib.SETTINGS:
    if s.smollm2 and smol:
      name, extra, label = SMOLLM2, DOCS_SMOLLM2, 'SmolLM2-135M'
    else:
      name, extra = s.config or TINY, DOCS_TINY
      label = f'tiny ({name})'
    base = _with(settings_lib.load_config(name), extra)
    plan.append((s, label, settings_lib.apply(s, base)))
  # Grouped by model, the tiny ones first (a failing special config shows
  # in minutes, not after the SmolLM2 rows).
  return sorted(plan, key=lambda entry: entry[1] == 'SmolLM2-135M')


def cli_plan(
  config: ml_collections.ConfigDict,
  names: Sequence[str],
  prompts: int | None,
  label: str,
) -> list[tuple[Setting, str, Any]]:
  """`--settings` on `--config` (a setting with a config of its own uses
  that one's tiny model)."""
  plan = []
  for s in settings_lib.by_name(list(names)):
    base, model = config, label
    if s.config:
      base, model = settings_lib.load_config(s.config), f'tiny ({s.config})'
    if prompts:
      base = _with(base, [('rollout.prompts_per_step', prompts)])
    plan.append((s, model, settings_lib.apply(s, base)))
  return plan


def run_plan(plan, workdir: str | None) -> list[dict[str, Any]]:
  """Measure each entry; one record per setting (printed as it lands).

  One persistent compilation cache for the whole plan (unless JAX has
  one): settings that differ only in the engine share the trainer's
  compiled programs (`jaxcorr.train.compile_cache`)."""
  from jaxcorr.parity.measure import measure
  from jaxcorr.train import compile_cache

  records = []
  with tempfile.TemporaryDirectory(dir=workdir) as scratch:
    compile_cache.enable(os.path.join(scratch, 'compile_cache'), '')
    for setting, model, config in plan:
      try:
        record = _record(setting, model, measure(config, scratch))
      except Exception as e:  # one row fails, not the plan
        first = (str(e).strip().splitlines() or [''])[0]
        why = f'{type(e).__name__}: {first[:300]}'
        record = dict(_record_head(setting, model, 0.0), bands={}, error=why)
        print(f'error: setting {setting.name!r}: {why}', file=sys.stderr)
      records.append(record)
      print(report.markdown_table(records[-1:]).splitlines()[-1], flush=True)
  return records


def _record_head(setting: Setting, model: str, seconds: float):
  return dict(setting=setting.name, what=setting.what, model=model,
              seconds=seconds)  # fmt: skip


def _record(setting: Setting, model: str, m: Any) -> dict[str, Any]:
  """One table record of a `Measured`."""
  from jaxcorr.parity.bands import parity_bands

  bands = parity_bands(
    m.pi,
    m.mu,
    m.mask,
    argmax_pi=m.argmax_pi,
    argmax_mu=m.argmax_mu,
    argmax_mask=m.argmax_mask,
  )
  return dict(_record_head(setting, model, m.seconds), bands=bands)


def main(argv: Sequence[str]) -> None:
  from absl import app, flags

  f = flags.FLAGS
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  console.quiet_libraries()
  if f.all and f['settings'].present:
    raise app.UsageError('--all runs the docs plan: drop --settings')
  try:
    if f.all:
      plan = docs_plan()
    else:
      label = os.path.splitext(os.path.basename(_config_file()))[0]
      plan = cli_plan(f.config, f.settings, f.prompts, label)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  print(report.markdown_table([]), flush=True)  # the head; rows follow
  records = run_plan(plan, f.workdir)
  if f.out:
    for path in report.write(records, f.out):
      print(f'wrote {path}')
  failed = [r['setting'] for r in records if 'error' in r]
  if failed:
    sys.exit(f'error: {len(failed)} setting(s) failed: {", ".join(failed)}')


def _config_file() -> str:
  from absl import flags
  from ml_collections import config_flags

  return config_flags.get_config_filename(flags.FLAGS['config'])


def _define_flags() -> None:
  from absl import flags

  console.config_file_flag(
    'config', f'configs/{TINY}.py', 'The model and task: a config file'
  )
  flags.DEFINE_list(
    'settings',
    ['fp32'],
    'Settings to compare, from: '
    + ', '.join(s.name for s in settings_lib.SETTINGS),
  )
  flags.DEFINE_bool(
    'all', False, 'The docs plan: every setting, SmolLM2 where it applies.'
  )
  flags.DEFINE_integer(
    'prompts', None, 'Prompts per setting (default: rollout.prompts_per_step).'
  )
  flags.DEFINE_string(
    'out', None, 'Also write results.json, results.md and parity.png here.'
  )
  flags.DEFINE_string(
    'workdir', None, 'Where the scratch run directories go (default: $TMPDIR).'
  )


if __name__ == '__main__':
  _define_flags()
  console.run(main)
