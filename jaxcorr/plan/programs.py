"""Lower and compile a run's programs on abstract inputs, and what each
compiled program says about itself.

    compile_program(name, jitted, *args) -> Program: XLA's memory analysis
        (per device: arguments, outputs, aliased, temporaries) and the
        collective traffic of one call (`plan.collectives`)
    plan_programs(run, cfg, train_mesh, engine_mesh) -> Plan: the trainer's
        `prepare` and `update` (jaxcorr/train/step.py) and the engine's
        `decode_chunk` (jaxcorr/rollout/decode.py), compiled for the meshes,
        with the per-device bytes of the state they carry

No array is allocated: the inputs are `jax.ShapeDtypeStruct`s placed as a
run places the real ones (`plan.abstract`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax

from jaxcorr.model import TransformerConfig
from jaxcorr.plan import abstract
from jaxcorr.plan.collectives import Traffic, collective_bytes
from jaxcorr.train.run_config import RunConfig


def device_bytes(tree: Any) -> int:
  """Bytes one device holds of the abstract arrays of `tree` (its shard
  of each, the whole array when replicated)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding else x.shape
    total += math.prod(shape) * x.dtype.itemsize
  return total


@dataclasses.dataclass
class Program:
  """One compiled program's figures, per device (bytes)."""

  name: str
  argument_bytes: int
  output_bytes: int
  alias_bytes: int  # outputs written into donated arguments
  temp_bytes: int  # activations and workspace XLA allocates
  traffic: Traffic
  compile_s: float

  @property
  def peak_bytes(self) -> int:
    """Arguments + temporaries + outputs not written in place: what the
    call needs resident at once (an upper bound: XLA's own estimate)."""
    return (
      self.argument_bytes
      + self.temp_bytes
      + self.output_bytes
      - self.alias_bytes
    )


def compile_program(
  name: str,
  jitted: Any,
  *args: Any,
  loop_bound: int | None = None,
  **kwargs: Any,
) -> tuple[Program, Any]:
  """(figures, executable) of `jitted.lower(*args, **kwargs).compile()`;
  `loop_bound`: the trip count of its loops XLA cannot bound
  (`collective_bytes`)."""
  t0 = time.perf_counter()
  compiled = jitted.lower(*args, **kwargs).compile()
  seconds = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  figures = Program(
    name=name,
    argument_bytes=mem.argument_size_in_bytes,
    output_bytes=mem.output_size_in_bytes,
    alias_bytes=mem.alias_size_in_bytes,
    temp_bytes=mem.temp_size_in_bytes,
    traffic=collective_bytes(compiled.as_text(), loop_bound),
    compile_s=seconds,
  )
  return figures, compiled


@dataclasses.dataclass
class Plan:
  """The compiled programs of a run and the per-device bytes of what they
  carry between calls."""

  config: TransformerConfig
  param_count: int
  train_devices: int
  engine_devices: int
  batch_rows: int
  param_bytes: int  # the policy's trained params (one device's shard)
  optimizer_bytes: int  # its optimizer state
  ref_bytes: int  # the frozen reference policy (0 when none)
  batch_bytes: int  # the step's batch after prepare
  engine_param_bytes: int  # the engine's copy, at its dtype
  kv_bytes: int  # the engine's decode state (KV cache and slots)
  programs: list[Program]


def plan_programs(
  run: RunConfig,
  cfg: TransformerConfig,
  train_mesh: jax.sharding.Mesh,
  engine_mesh: jax.sharding.Mesh,
) -> Plan:
  """Compile `prepare`, `update` and the engine's decode chunk of `run`
  for a policy of config `cfg` (module docstring)."""
  learner = abstract.abstract_learner(run, cfg, train_mesh)
  state, steps = learner.state, learner.steps
  batch = abstract.abstract_batch(run, train_mesh)
  programs = []
  with jax.set_mesh(train_mesh):
    args = (
      state.params,
      state.critic_params,
      state.kl_ctrl,
      learner.ref_params,
      batch,
    )
    prep, compiled = compile_program('prepare', steps.prepare, *args)
    # The update reads prepare's batch where prepare leaves it.
    _, prepared, _ = jax.eval_shape(steps.prepare, *args)
    out = compiled.output_shardings[1]
    prepared = abstract.with_shardings(prepared, out)
    upd, _ = compile_program('update', steps.update, state, prepared)
    programs += [prep, upd]
  engine = abstract.abstract_engine(run, cfg, engine_mesh)
  r = run.rollout
  with jax.set_mesh(engine_mesh):
    scalar = jax.ShapeDtypeStruct(
      (), 'int32', sharding=engine.stop_ids.sharding
    )
    decode, _ = compile_program(
      'decode_chunk',
      engine.programs.chunk,
      engine.params,
      engine.state,
      engine.stop_ids,
      scalar,
      num_steps=r.decode_chunk,
      attend_len=r.max_prompt_length + r.max_new_tokens,
    )
    programs.append(decode)
  count = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
  return Plan(
    config=cfg,
    param_count=count,
    train_devices=train_mesh.size,
    engine_devices=engine_mesh.size,
    batch_rows=batch.rows,
    param_bytes=device_bytes(state.params),
    optimizer_bytes=device_bytes(state.opt_state),
    ref_bytes=0
    if learner.ref_params is None
    else device_bytes(learner.ref_params),
    batch_bytes=device_bytes(prepared),
    engine_param_bytes=device_bytes(engine.params),
    kv_bytes=device_bytes(engine.state),
    programs=programs,
  )
