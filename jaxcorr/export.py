"""Export a trained policy to a Hugging Face directory.

  python -m jaxcorr.export --workdir=/tmp/arith --out=/tmp/arith_hf
  python -m jaxcorr.export --workdir=gs://bucket/run --out=/models/mine \\
      --step=200 --dtype=bfloat16

Reads the run's model section from `<workdir>/config.json` (written by
`jaxcorr.main` once the run started, with every override applied), builds
the model's shapes with the trainer's own mapping
(`jaxcorr.train.policy.transformer_config`), and restores only the policy's params of the latest (or
`--step`) checkpoint onto one device: no Trainer, no data, no reward
registry, no optimizer state. Then writes config.json + safetensors that
`transformers` loads (`jaxcorr.model.save_hf`), with the tokenizer's end
token as `eos_token_id` so `generate` stops there. For a model that came
from a HF checkpoint its tokenizer files are copied too (that directory
must still exist: it holds the architecture); the embedded arithmetic
task's character tokenizer has no HF equivalent, so only the weights and
config are written there, with its BOS/EOS/PAD ids.

`--out` is checked before anything is written: a directory equal to or
inside the workdir, or inside any run directory (one holding config.json
with `checkpoints/` or `metrics.jsonl`), is refused, since the export's
config.json would replace the run's and lose its config; any other
non-empty directory needs `--force` (files of the same name are then
replaced).

LoRA runs (`config.lora.rank > 0`) checkpoint only the adapters: `--adapter`
writes them as a PEFT directory for the run's base model, float32 tensors
or `--dtype` (`jaxcorr.model.peft_io.save_peft`;
`peft.PeftModel.from_pretrained(base, out)` loads it), and without it the
adapters are merged into the base (the HF checkpoint of
`config.model.hf_path`, or the scratch init of `config.model.init_seed`)
and written through the same HF path.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
from absl import app, flags
from etils import epath
from flax import nnx

from jaxcorr import console
from jaxcorr.train.checkpoints.workdir import check_output_dir, read_config

_WORKDIR = flags.DEFINE_string('workdir', None, 'The training run directory.')
_OUT = flags.DEFINE_string('out', None, 'Output Hugging Face directory.')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: latest).')
_DTYPE = flags.DEFINE_enum(
  'dtype', None, ['float32', 'bfloat16', 'float16'], 'Saved dtype.'
)
_ADAPTER = flags.DEFINE_bool(
  'adapter',
  False,
  'LoRA runs: write the adapters as a PEFT directory (adapter_config.json '
  '+ adapter_model.safetensors) instead of the merged model.',
)
_FORCE = flags.DEFINE_bool(
  'force', False, 'Write into a non-empty --out (never into a run directory).'
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
  config = ml_collections.ConfigDict(read_config(workdir))  # names a bad file
  config.lock()
  return config


def check_out(workdir: str, out: str, *, force: bool = False) -> None:
  """ValueError when exporting to `out` could damage a run or other files
  (module doc; `workdir.check_output_dir`)."""
  check_output_dir(
    workdir,
    out,
    flag='--out',
    writes="the export writes config.json there, replacing the run's own",
    force=force,
  )


def model_config(config: Any) -> Any:
  """The policy's `TransformerConfig` from a run config's model section
  (checked, and mapped as the trainer maps it), with the run tokenizer's
  special ids (module doc). Only `config.model` is read: the run's data
  and reward functions need not exist here."""
  from jaxcorr.config import convert
  from jaxcorr.data.text import make_tokenizer
  from jaxcorr.train.policy import ModelConfig, transformer_config

  model = convert.build(
    ModelConfig, 'config.model', convert.values(config.model)
  )
  if model.hf_path and not os.path.isdir(model.hf_path):
    raise FileNotFoundError(
      f"config.model.hf_path={model.hf_path!r} (the run's base model) is "
      'gone: its config.json holds the architecture to export'
    )
  cfg = transformer_config(model)
  if model.hf_path:
    return cfg
  tok = make_tokenizer('', cfg)
  return dataclasses.replace(
    cfg,
    bos_token_id=tok.bos_id,
    eos_token_id=tok.eos_id,
    pad_token_id=tok.pad_id,
  )


def export(
  workdir: str,
  out: str,
  *,
  step: int | None = None,
  dtype: str | None = None,
  force: bool = False,
  adapter: bool = False,
) -> int:
  """Writes the policy of `workdir`'s checkpoint to `out` (`adapter`: a
  LoRA run's adapters as PEFT); returns the step. `out` is checked first
  (`check_out`)."""
  from jaxcorr.model import Transformer, save_hf
  from jaxcorr.train.checkpoints import checkpointer as checkpoint

  config = load_run_config(workdir)
  check_out(workdir, out, force=force)
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
  lora = _lora(config)
  if lora is not None:
    return _export_lora(config, cfg, lora, ckpt_dir, out, step, dtype, adapter)
  if adapter:
    raise ValueError(
      f'--adapter: the run in {workdir} is not a LoRA run (config.lora.rank '
      'is 0); export it without --adapter'
    )
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


def _lora(config: Any) -> Any:
  """The run's `LoraConfig` when it trained adapters, else None."""
  from jaxcorr.config import convert
  from jaxcorr.model.lora import LoraConfig

  if 'lora' not in config:
    return None
  lora = convert.build(LoraConfig, 'config.lora', convert.values(config.lora))
  return lora if lora.enabled else None


def _export_lora(config, cfg, lora, ckpt_dir, out, step, dtype, adapter):
  """A LoRA run's checkpoint: PEFT adapters, or merged into the base."""
  from jaxcorr.model import Transformer, load_hf, save_hf
  from jaxcorr.model.lora import (
    apply_lora,
    lora_model,
    merge_into,
    split_adapter,
  )
  from jaxcorr.model.peft_io import save_peft
  from jaxcorr.train.checkpoints import checkpointer as checkpoint

  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  shapes, _ = split_adapter(
    nnx.state(nnx.eval_shape(lambda: lora_model(cfg, lora)))
  )
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), shapes
  )
  with checkpoint.Checkpointer(
    ckpt_dir, every=0, keep=1, read_only=True
  ) as ckpt:
    params, _, step = ckpt.restore_subtree(
      ('state', 'params'), target, step=step
    )
  hf_path = config.model.hf_path
  if adapter:
    save_peft(params, lora, out, base_model=hf_path, model=cfg, dtype=dtype)
    return step
  if hf_path:
    base = load_hf(
      hf_path,
      param_dtype=cfg.param_dtype,
      dtype=cfg.dtype,
      scan_layers=cfg.scan_layers,
    )
  else:  # the trainer's scratch init (same seed, same values)
    base = Transformer(cfg, rngs=nnx.Rngs(config.model.init_seed))
  graphdef, plain = nnx.split(base)
  full = nnx.merge_state(nnx.state(apply_lora(base, lora)), params)
  merged = merge_into(plain, full, lora.scale)
  save_hf(
    nnx.merge(graphdef, merged), out, dtype=dtype, tokenizer_dir=hf_path or None
  )
  return step


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  try:
    step = export(
      _WORKDIR.value,
      _OUT.value,
      step=_STEP.value,
      dtype=_DTYPE.value,
      force=_FORCE.value,
      adapter=_ADAPTER.value,
    )
  except (FileNotFoundError, ValueError) as e:
    raise app.UsageError(str(e)) from None
  print(f'exported step {step} of {_WORKDIR.value} to {_OUT.value}')


if __name__ == '__main__':
  flags.mark_flags_as_required(['workdir', 'out'])
  console.run(main)
