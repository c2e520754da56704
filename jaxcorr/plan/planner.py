"""From a config, a model preset and a mesh to a compiled `Plan`.

`target` applies the preset to `config.model` (a scratch model of that
shape: nothing is read from disk), sets `config.mesh`, validates the run
with `jaxcorr.train.build.build` like `jaxcorr.main` does, and builds the
trainer's mesh and the engine's (each process's engine runs on its host's
chips, `jaxcorr.train.setup.make_meshes`) from the first devices: every
user error is found there, before the minutes of compiling.
`compile_plan` compiles the programs (`plan.programs.plan_programs`);
`make_plan` is both.

The devices are fake CPU devices (`jax_num_cpu_devices`, set by the
command before JAX starts): XLA partitions for the mesh shape, not for the
chip, so the shapes, shardings and collectives are those of the pod; the
byte counts are the CPU compiler's, whose buffer assignment is close to but
not the TPU compiler's (docs/tpu.md).
"""

from __future__ import annotations

import dataclasses

import jax
import ml_collections

from jaxcorr import sharding
from jaxcorr.plan import presets
from jaxcorr.plan.programs import Plan, plan_programs
from jaxcorr.train import build
from jaxcorr.train.policy import transformer_config
from jaxcorr.train.run_config import RunConfig


def apply_model(config: ml_collections.ConfigDict, model: str) -> None:
  """`config.model` set to preset `model`'s shape ('' keeps the config's
  model, which then needs its `hf_path` config.json)."""
  if not model:
    return
  if model not in presets.MODELS:
    raise ValueError(
      f'--model={model!r}; allowed: {", ".join(sorted(presets.MODELS))}'
    )
  with config.unlocked():
    config.model.hf_path = ''
    for k, v in presets.MODELS[model].items():
      config.model[k] = v


@dataclasses.dataclass(frozen=True)
class Target:
  """A validated run and the meshes its programs compile for."""

  run: RunConfig
  train_mesh: jax.sharding.Mesh
  engine_mesh: jax.sharding.Mesh


def target(
  config: ml_collections.ConfigDict,
  *,
  model: str,
  mesh: str,
  engine_devices: int,
) -> Target:
  """`config` with preset `model` on `mesh` ('fsdp:64'), validated, and
  the meshes: the engine on `engine_devices` chips (0: the trainer's mesh,
  as in a single-process run). Every ValueError is the user's (a field, a
  flag), raised before anything compiles. Needs as many devices as the
  mesh has."""
  mesh_config, n = presets.parse_mesh(mesh)
  apply_model(config, model)
  with config.unlocked():
    for axis in sharding.MESH_AXES:
      config.mesh[axis] = getattr(mesh_config, axis)
  run = build.build(config)
  devices = jax.devices()
  if len(devices) < n:
    raise ValueError(f'--mesh={mesh} needs {n} devices, have {len(devices)}')
  train_mesh = sharding.make_mesh(run.mesh, devices=devices[:n])
  engine_mesh = sharding.engine_mesh(train_mesh)  # rows never split
  if engine_devices:
    if n % engine_devices:
      raise ValueError(
        f'--engine_devices={engine_devices} must divide the {n} devices'
      )
    engine_mesh = sharding.make_mesh(
      sharding.MeshConfig(1, -1, 1), devices=devices[:engine_devices]
    )
  return Target(run, train_mesh, engine_mesh)


def compile_plan(t: Target) -> Plan:
  """The `Plan` of a `target`: its programs compiled (`model.dtype='auto'`
  as a TPU run resolves it: bfloat16 compute)."""
  cfg = transformer_config(t.run.model, backend='tpu')
  return plan_programs(t.run, cfg, t.train_mesh, t.engine_mesh)


def make_plan(
  config: ml_collections.ConfigDict,
  *,
  model: str,
  mesh: str,
  engine_devices: int,
) -> Plan:
  """`compile_plan(target(...))`."""
  return compile_plan(
    target(config, model=model, mesh=mesh, engine_devices=engine_devices)
  )
