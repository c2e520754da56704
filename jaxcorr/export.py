"""Export a trained policy to a Hugging Face directory.

  python -m jaxcorr.export --workdir=/tmp/arith --out=/tmp/arith_hf
  python -m jaxcorr.export --workdir=gs://bucket/run --out=/models/mine \\
      --step=200 --dtype=bfloat16

Reads `<workdir>/config.json` (written by `jaxcorr.main` at start-up, with
every override applied), rebuilds the run's model and state layout, restores
the latest (or `--step`) checkpoint and writes config.json + safetensors
that `transformers` loads (`jaxcorr.model.save_hf`). For a model that came
from a HF checkpoint its tokenizer files are copied too; the embedded
arithmetic task's character tokenizer has no HF equivalent, so only the
weights and config are written there.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import ml_collections
from absl import app, flags
from etils import epath
from flax import nnx

_WORKDIR = flags.DEFINE_string('workdir', None, 'The training run directory.')
_OUT = flags.DEFINE_string('out', None, 'Output Hugging Face directory.')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: latest).')
_DTYPE = flags.DEFINE_enum(
  'dtype', None, ['float32', 'bfloat16', 'float16'], 'Saved dtype.'
)

CONFIG_FILE = 'config.json'


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
  """The locked ConfigDict a run in `workdir` was started with."""
  path = epath.Path(workdir) / CONFIG_FILE
  if not path.is_file():
    raise FileNotFoundError(
      f'{path} not found: --workdir must be a directory written by '
      'python -m jaxcorr.main'
    )
  config = ml_collections.ConfigDict(json.loads(path.read_text()))
  config.lock()
  return config


def export(
  workdir: str, out: str, *, step: int | None = None, dtype: str | None = None
) -> int:
  """Writes the policy of `workdir`'s checkpoint to `out`; returns the step."""
  from jaxcorr.model import save_hf
  from jaxcorr.train.loop import Trainer

  trainer = Trainer(load_run_config(workdir), workdir, read_only=True)
  if not trainer.restore(step=step):
    raise FileNotFoundError(f'no checkpoint in {workdir}')
  model = nnx.merge(trainer.graphdef, trainer.state.params)
  save_hf(
    model,
    out,
    dtype=dtype,
    tokenizer_dir=trainer.run.model.hf_path or None,
  )
  return trainer.step


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  step = export(
    _WORKDIR.value, _OUT.value, step=_STEP.value, dtype=_DTYPE.value
  )
  print(f'exported step {step} of {_WORKDIR.value} to {_OUT.value}')


if __name__ == '__main__':
  flags.mark_flags_as_required(['workdir', 'out'])
  app.run(main)
