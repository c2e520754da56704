"""jaxcorr.plan: a tiny run's programs compiled on abstract arrays over 4
fake devices; the abstract state is placed exactly as a real run's."""

from __future__ import annotations

import math
import pathlib
import subprocess
import sys

import jax
import pytest
from flax import nnx

from jaxcorr.model import Transformer
from jaxcorr.plan import planner, presets, report
from jaxcorr.plan.abstract import abstract_learner, abstract_module
from jaxcorr.plan.programs import device_bytes
from jaxcorr.train import build, setup
from jaxcorr.train.policy import build_policy, transformer_config
from tests.helpers.trainer_config import pulse_config

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tiny():
  """The pulse config at one layer, one update of one micro-batch."""
  return pulse_config(model__num_layers=1)


def test_plan_of_a_tiny_run():
  plan = planner.make_plan(_tiny(), model='', mesh='fsdp:4', engine_devices=2)
  assert (plan.train_devices, plan.engine_devices) == (4, 2)
  assert [p.name for p in plan.programs] == [
    'prepare', 'update', 'decode_chunk'
  ]  # fmt: skip
  full = plan.param_count * 4  # float32
  # Every matrix's embed axis is split over fsdp; the norms are not.
  assert full / 4 <= plan.param_bytes < full / 2
  # AdamW: two moments shaped and placed like the params (not replicated:
  # jaxcorr.train.state.init_optimizer), and a count.
  assert 2 * plan.param_bytes <= plan.optimizer_bytes
  assert plan.optimizer_bytes <= 2 * plan.param_bytes + 64
  _, update, decode = plan.programs
  # (jit drops the batch fields the update never reads.)
  held = plan.param_bytes + plan.optimizer_bytes
  assert held <= update.argument_bytes <= held + plan.batch_bytes + 64
  assert update.alias_bytes >= plan.param_bytes  # the state is donated
  # FSDP: the update gathers the sharded weights and reduces gradients.
  assert update.traffic.kinds['all-gather'].count > 0
  assert update.traffic.kinds['all-reduce'].count > 0
  assert decode.traffic.unknown_loops >= 1  # the chunk's early-exit loop
  assert decode.argument_bytes >= plan.engine_param_bytes + plan.kv_bytes
  text = report.format_plan(plan, {'v6e': presets.HBM_BYTES['v6e']})
  assert 'decode_chunk' in text and 'v6e' in text and 'fits' in text


def test_abstract_state_is_placed_as_the_real_one():
  run = build.build(_tiny())
  mesh = setup.make_meshes(run).train
  policy = build_policy(run.model, mesh)
  state, _ = setup.build_learner(run, policy, mesh)
  learner = abstract_learner(run, transformer_config(run.model), mesh)
  assert jax.tree.structure(state) == jax.tree.structure(learner.state)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(learner.state)):
    assert (a.shape, a.dtype) == (b.shape, b.dtype)
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
  # FSDP shards the AdamW moments like the params.
  mu = jax.tree.leaves(state.opt_state[1][0].mu)
  assert any(not x.sharding.is_fully_replicated for x in mu)


def test_presets_and_mesh_syntax():
  assert presets.parse_mesh('fsdp:64')[1] == 64
  cfg, n = presets.parse_mesh('data:2,fsdp:8,tensor:2')
  assert (cfg.data, cfg.fsdp, cfg.tensor, n) == (2, 8, 2, 32)
  for bad in ('fsdp', 'fsdp:0', 'pipeline:4', 'fsdp:x'):
    with pytest.raises(ValueError, match='axis:size'):
      presets.parse_mesh(bad)
  with pytest.raises(ValueError, match='allowed: llama3_70b, llama3_8b'):
    planner.apply_model(_tiny(), 'llama4')
  config = _tiny()
  planner.apply_model(config, 'llama3_8b')
  cfg = transformer_config(build.build(config).model)
  mesh = setup.make_meshes(build.build(_tiny())).train  # fsdp over 8
  _, params = abstract_module(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
  count = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  assert count == 8_030_261_248  # Llama-3.1-8B, no weight allocated
  # Each matrix is split over fsdp=8 (its embed dimension); the 65 norm
  # scales are not.
  norms = (2 * 32 + 1) * 4096
  assert device_bytes(params) == (count - norms) * 4 // 8 + norms * 4


def test_an_unknown_chip_is_one_line_before_compiling():
  """`--chip=v7x` was a KeyError traceback after the whole compile: now
  it is checked first and the error lists the known chips."""
  proc = subprocess.run(
    [sys.executable, '-m', 'jaxcorr.plan', '--chip=v5p,v7x', '--mesh=fsdp:4'],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines() == [
    'error: --chip=v5p,v7x: unknown chip v7x; allowed: a comma-separated '
    'list of v4, v5e, v5p, v6e'
  ]
  assert presets.chip_hbm(['v5p']) == {'v5p': presets.HBM_BYTES['v5p']}
