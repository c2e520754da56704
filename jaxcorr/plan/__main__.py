"""`python -m jaxcorr.plan`: what a run needs per chip, from the compiler
(a thin absl entry; the work is `jaxcorr.plan.planner`: `target`, then
`compile_plan`).

  python -m jaxcorr.plan --model=llama3_8b --mesh=fsdp:64
  python -m jaxcorr.plan --config=configs/llama8b_fsdp.py --model=llama3_8b \\
      --mesh=fsdp:32 --chip=v5p --config.train.micro_batches=8

Fakes as many CPU devices as the mesh has, compiles the run's `prepare`,
`update` and the engine's `decode_chunk` on abstract arrays (no weights
are allocated) and prints the per-device bytes, XLA's memory analysis and
the collective traffic of each program (docs/tpu.md).

Every flag and config field is checked before anything compiles; a bad one
is one line, `error: ...` (`jaxcorr.console.run`), exit status 1.
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import app, flags

from jaxcorr import console

_CONFIG = console.config_file_flag(
  'config',
  'configs/llama8b_fsdp.py',
  'The run config (file[:config string]); its batch geometry, lengths, '
  'dtypes, remat and algorithm are what is compiled.',
)
_MODEL = flags.DEFINE_string(
  'model',
  'llama3_8b',
  "A model shape of jaxcorr/plan/presets.py ('': the config's model, whose "
  'hf_path config.json must exist).',
)
_MESH = flags.DEFINE_string(
  'mesh',
  'fsdp:64',
  'Trainer mesh, axis:size,... (data, fsdp, sequence, tensor).',
)
_ENGINE = flags.DEFINE_integer(
  'engine_devices',
  4,
  "Chips of each process's engine (a host's: 4 on v4/v5p/v6e slices); 0: "
  "the trainer's whole mesh (a single-process run).",
)
_CHIP = flags.DEFINE_list(
  'chip', ['v5p', 'v6e'], 'Chips whose HBM the peak is compared with.'
)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  import jax

  from jaxcorr.plan import presets

  console.quiet_libraries()
  try:
    hbm = presets.chip_hbm(_CHIP.value)
    _, devices = presets.parse_mesh(_MESH.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  # Before anything touches a backend: the pod's devices, faked on CPU.
  jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_num_cpu_devices', devices)
  from jaxcorr.plan import planner, report

  try:
    target = planner.target(
      _CONFIG.value,
      model=_MODEL.value,
      mesh=_MESH.value,
      engine_devices=_ENGINE.value,
    )
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  print(report.format_plan(planner.compile_plan(target), hbm))


if __name__ == '__main__':
  console.run(main)
