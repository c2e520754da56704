"""Export a trained policy to a Hugging Face directory.

  python -m jaxcorr.export --workdir=/tmp/arith --out=/tmp/arith_hf
  python -m jaxcorr.export --workdir=gs://bucket/run --out=/models/mine \\
      --step=200 --dtype=bfloat16

Reads the run's model section from `<workdir>/config.json` (written by
`jaxcorr.main` once the run started, with every override applied), builds
the model's shapes, and restores only the policy's params of the latest (or
`--step`) checkpoint onto one device: no Trainer, no data, no reward
registry, no optimizer state. Then writes config.json + safetensors that
`transformers` loads (`jaxcorr.model.save_hf`), with the tokenizer's end
token as `eos_token_id` so `generate` stops there. For a model that came
from a HF checkpoint its tokenizer files are copied too (that directory
must still exist: it holds the architecture); the embedded arithmetic
task's character tokenizer has no HF equivalent, so only the weights and
config are written there, with its BOS/EOS/PAD ids.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
from absl import app, flags
from etils import epath
from flax import nnx

from jaxcorr.train.checkpoints.workdir import read_config

_WORKDIR = flags.DEFINE_string('workdir', None, 'The training run directory.')
_OUT = flags.DEFINE_string('out', None, 'Output Hugging Face directory.')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: latest).')
_DTYPE = flags.DEFINE_enum(
  'dtype', None, ['float32', 'bfloat16', 'float16'], 'Saved dtype.'
)

CONFIG_FILE = 'config.json'

# config.model fields that are TransformerConfig fields of a scratch model.
_SCRATCH_FIELDS = (
  'vocab_size',
  'hidden_size',
  'intermediate_size',
  'num_layers',
  'num_heads',
  'num_kv_heads',
  'tie_embeddings',
  'rope_theta',
  'max_position_embeddings',
  'initializer_range',
  'dtype',
  'param_dtype',
  'remat',
  'scan_layers',
)


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
  """The locked ConfigDict a run in `workdir` was started with."""
  path = epath.Path(workdir) / CONFIG_FILE
  if not path.is_file():
    raise FileNotFoundError(
      f'{path} not found: --workdir must be a directory written by '
      'python -m jaxcorr.main'
    )
  config = ml_collections.ConfigDict(read_config(workdir))  # names a bad file
  config.lock()
  return config


def model_config(config: Any) -> Any:
  """The policy's `TransformerConfig` from a run config's model section,
  with the run tokenizer's special ids (module doc)."""
  from jaxcorr.model import TransformerConfig

  m = config.model
  if m.hf_path:
    if not os.path.isdir(m.hf_path):
      raise FileNotFoundError(
        f"config.model.hf_path={m.hf_path!r} (the run's base model) is "
        'gone: its config.json holds the architecture to export'
      )
    return TransformerConfig.from_hf_config(
      m.hf_path,
      param_dtype=m.param_dtype,
      dtype=m.dtype,
      remat=m.remat,
      scan_layers=m.scan_layers,
    )
  from jaxcorr.data.tasks import CharTokenizer

  tok = CharTokenizer()
  return TransformerConfig(
    **{k: m[k] for k in _SCRATCH_FIELDS},
    bos_token_id=tok.bos_id,
    eos_token_id=tok.eos_id,
    pad_token_id=tok.pad_id,
  )


def export(
  workdir: str, out: str, *, step: int | None = None, dtype: str | None = None
) -> int:
  """Writes the policy of `workdir`'s checkpoint to `out`; returns the step."""
  from jaxcorr.model import Transformer, save_hf
  from jaxcorr.train.checkpoints import checkpointer as checkpoint

  config = load_run_config(workdir)
  ckpt_dir = os.path.join(workdir, 'checkpoints')
  if not (
    epath.Path(ckpt_dir).is_dir()
    and any(p.name.isdigit() for p in epath.Path(ckpt_dir).iterdir())
  ):
    raise FileNotFoundError(
      f'no checkpoint in {ckpt_dir}: the run in {workdir} has not saved a '
      'step yet (the first is written after the SFT warm-up)'
    )
  cfg = model_config(config)
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, shapes = nnx.split(abstract)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), shapes
  )
  with checkpoint.Checkpointer(
    ckpt_dir, every=0, keep=1, read_only=True
  ) as ckpt:
    params, _, step = ckpt.restore_subtree(
      ('state', 'params'), target, step=step
    )
  save_hf(
    nnx.merge(graphdef, params),
    out,
    dtype=dtype,
    tokenizer_dir=config.model.hf_path or None,
  )
  return step


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  try:
    step = export(
      _WORKDIR.value, _OUT.value, step=_STEP.value, dtype=_DTYPE.value
    )
  except FileNotFoundError as e:
    raise app.UsageError(str(e)) from None
  print(f'exported step {step} of {_WORKDIR.value} to {_OUT.value}')


if __name__ == '__main__':
  flags.mark_flags_as_required(['workdir', 'out'])
  app.run(main)
