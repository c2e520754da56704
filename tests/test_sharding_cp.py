"""Context parallelism (the `sequence` mesh axis) over the 8 fake CPU
devices: rows split along their positions give the loss, the log-probs and
every gradient of the unsplit model, packed or not, composed with fsdp and
tensor; the mesh rules and the engine's mesh."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxcorr import sharding as sh
from jaxcorr.model import logprobs_from_hidden, token_logprobs
from jaxcorr.model.context_parallel import sequence_shards
from jaxcorr.plan import planner, presets
from jaxcorr.train import build
from jaxcorr.train.packing import layout
from tests.helpers.model_testing import (
  random_model,
  random_tokens,
  shard_batch,
  stack_layers,
  tiny_config,
)
from tests.helpers.step_batches import step_arrays
from tests.helpers.trainer_config import pulse_config
from tests.helpers.wide_rows import widen
from tests.model.test_moe import moe_config
from tests.train.packing.test_packed_step import _step

S = 32  # row length: divides by every sequence axis below


def _segments(batch: int) -> np.ndarray:
  """Packed rows: three sequences of unequal length, then padding (0); the
  boundaries fall inside the shards of a 4-way split (8 positions each)."""
  row = np.repeat([1, 2, 3, 0], [5, 14, 9, 4])
  return np.stack([np.roll(row, i) for i in range(batch)]).astype(np.int32)


def _run(graphdef, state, tokens, segment_ids, weights):
  """(loss, log-probs [B, S-1], grads) of a weighted log-prob sum."""

  def loss(state):
    m = nnx.merge(graphdef, state)
    lp = token_logprobs(
      m, tokens, temperature=0.7, segment_ids=segment_ids, chunk_size=4
    )
    return jnp.sum(weights * lp), lp

  (value, lp), grads = jax.value_and_grad(loss, has_aux=True)(state)
  return value, lp, grads


def _assert_grads_close(got, ref):
  g_ref, g_got = stack_layers(ref), stack_layers(got)
  for k in g_ref:
    # float32 reordering noise scales with the summed terms (the tied
    # embedding's gradient sums every position's head and lookup terms).
    atol = max(1e-6, 1e-6 * float(np.abs(g_ref[k]).max()))
    np.testing.assert_allclose(
      g_got[k], g_ref[k], atol=atol, rtol=1e-5, err_msg=str(k)
    )


@pytest.mark.parametrize(
  'mesh_config, packed',
  [
    (dict(fsdp=2, sequence=4), True),
    (dict(fsdp=1, sequence=4, tensor=2), True),
    (dict(fsdp=2, sequence=4), False),
  ],
)
def test_context_parallel_equals_unsplit(mesh_config, packed):
  """The sequence axis changes where positions live, not what they give:
  loss, log-probs and gradients as on one device (float32, 1e-6)."""
  model = random_model(tiny_config(scan_layers=True, remat='full'))
  b = 4
  tokens = random_tokens(b, S)
  segment_ids = jnp.asarray(_segments(b)) if packed else None
  weights = jax.random.normal(jax.random.key(0), (b, S - 1))
  graphdef, state = nnx.split(model)
  ref = jax.jit(_run, static_argnums=0)(
    graphdef, state, tokens, segment_ids, weights
  )

  mesh = sh.make_mesh(mesh_config)
  placed = jax.device_put(state, sh.param_shardings(state, mesh))
  batch = shard_batch(dict(t=tokens, s=segment_ids, w=weights), mesh)
  with jax.set_mesh(mesh):
    assert sequence_shards() == 4
    got = jax.jit(_run, static_argnums=0)(
      graphdef, placed, batch['t'], batch['s'], batch['w']
    )
    hlo = (
      jax.jit(_run, static_argnums=0)
      .lower(graphdef, placed, batch['t'], batch['s'], batch['w'])
      .compile()
      .as_text()
    )
  assert 'all-gather' in hlo  # K/V gathered over the sequence axis
  np.testing.assert_allclose(got[0], ref[0], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got[1], ref[1], rtol=1e-6, atol=1e-6)
  _assert_grads_close(got[2], ref[2])


def test_context_parallel_in_bfloat16():
  """bf16 compute: the K/V gather's backward (a reduce-scatter) adds in
  float32 (a bf16 one aborted XLA:CPU's compiler); loss and gradients as
  unsplit within bf16 rounding."""
  model = random_model(tiny_config(scan_layers=True, dtype=jnp.bfloat16))
  tokens = random_tokens(4, S)
  segment_ids = jnp.asarray(_segments(4))
  weights = jnp.ones((4, S - 1))
  graphdef, state = nnx.split(model)
  run = jax.jit(_run, static_argnums=0)
  ref = run(graphdef, state, tokens, segment_ids, weights)
  mesh = sh.make_mesh(dict(fsdp=2, sequence=4))
  placed = jax.device_put(state, sh.param_shardings(state, mesh))
  batch = shard_batch(dict(t=tokens, s=segment_ids, w=weights), mesh)
  with jax.set_mesh(mesh):
    got = run(graphdef, placed, batch['t'], batch['s'], batch['w'])
  np.testing.assert_allclose(got[0], ref[0], rtol=2e-3)
  for a, b in zip(jax.tree.leaves(got[2]), jax.tree.leaves(ref[2])):
    np.testing.assert_allclose(a, b, atol=5e-2 * float(np.abs(b).max()))


def test_rows_are_split_between_layers():
  """The hidden states leave the forward split over `sequence` (positions)
  and the batch over `fsdp`: the activations are 1/4 per device."""
  model = random_model(tiny_config(num_layers=1))
  mesh = sh.make_mesh(dict(fsdp=2, sequence=4))
  state = nnx.state(model)
  placed = jax.device_put(state, sh.param_shardings(state, mesh))
  graphdef = nnx.graphdef(model)
  tokens = shard_batch(random_tokens(4, S), mesh)

  @jax.jit
  def hidden(state, tokens):
    return nnx.merge(graphdef, state).hidden_states(tokens)[0]

  with jax.set_mesh(mesh):
    h = hidden(placed, tokens)
  assert h.sharding.spec[:2] == ('fsdp', 'sequence')
  assert h.addressable_shards[0].data.shape == (2, S // 4, 64)


def test_chunked_head_keeps_each_shard_local():
  """`logprobs_from_hidden` on sequence-split hidden states: equal to the
  unsplit head for a length that divides by the axis and for S - 1 (the
  usual shifted call), without gathering the [B, S, D] hidden states."""
  rng = np.random.default_rng(0)
  hid = jnp.asarray(rng.normal(size=(2, S, 16)), jnp.float32)
  head = jnp.asarray(rng.normal(size=(40, 16)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 40, (2, S)), jnp.int32)
  mesh = sh.make_mesh(dict(fsdp=2, sequence=4))
  split = jax.device_put(
    hid, jax.sharding.NamedSharding(mesh, P('fsdp', 'sequence', None))
  )

  def loss(h, t, cut):
    lp = logprobs_from_hidden(h[:, :cut], head, t[:, :cut], chunk_size=3)
    return jnp.sum(lp * jnp.arange(cut)), lp

  f = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=2)
  for cut in (S, S - 1):
    ref = f(hid, targets, cut)
    with jax.set_mesh(mesh):
      got = f(split, targets, cut)
      hlo = f.lower(split, targets, cut).compile().as_text()
    # Forward and backward stay on each device's own positions: what is
    # gathered is the [B, T] output, never [B, T, D] hidden states.
    moved = re.findall(r'= \w+\[([\d,]*)\]\S* (?:all-gather|all-to-all)\(', hlo)
    assert all(d.count(',') < 2 for d in moved), (cut, moved)
    np.testing.assert_allclose(got[0][1], ref[0][1], atol=1e-6)
    np.testing.assert_allclose(got[1], ref[1], atol=1e-6, err_msg=str(cut))


def test_context_parallel_moe_equals_unsplit():
  """MoE layers route each position on its own device: the same loss,
  gradients within float32 reordering of the expert sums."""
  from jaxcorr.model import Transformer

  cfg = moe_config(scan_layers=True, mlp_only_layers=())
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  tokens = jax.random.randint(jax.random.key(0), (4, S), 0, cfg.vocab_size)
  weights = jnp.ones((4, S - 1))
  run = jax.jit(_run, static_argnums=0)
  ref = run(graphdef, state, tokens, None, weights)
  mesh = sh.make_mesh(dict(fsdp=2, sequence=4))
  placed = jax.device_put(state, sh.param_shardings(state, mesh))
  batch = shard_batch(dict(t=tokens, w=weights), mesh)
  with jax.set_mesh(mesh):
    got = run(graphdef, placed, batch['t'], None, batch['w'])
  np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
  np.testing.assert_allclose(got[1], ref[1], rtol=1e-6, atol=1e-6)
  for a, b in zip(jax.tree.leaves(got[2]), jax.tree.leaves(ref[2])):
    np.testing.assert_allclose(a, b, atol=1e-5 * float(np.abs(b).max()))


@pytest.mark.slow  # ~2 min; the model tests above cover CP in CI
def test_rl_step_with_context_parallelism():
  """A whole prepare + update on fsdp=2 x sequence=4, rows unpacked and
  packed, against fsdp=8: the same metrics and updated params."""
  run = build.build(
    pulse_config(train__shuffle_minibatches=False, optim__warmup_steps=0)
  )
  arrays = widen(step_arrays(run, 8), 5)  # 16 positions: 4 per device
  _, ref, ref_metrics = _step(run, arrays, mesh=sh.make_mesh(dict(fsdp=8)))
  assert ref_metrics['actor/loss_token_count'] > 0
  mesh = sh.make_mesh(dict(fsdp=2, sequence=4))
  packed = layout.pack(arrays, mini_batches=1, micro_batches=1, shards=2)
  for pk in (None, packed):
    _, got, metrics = _step(run, arrays, pk, mesh=mesh)
    for k, v in ref_metrics.items():
      np.testing.assert_allclose(metrics[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
      np.testing.assert_allclose(a, b, atol=1e-6)


def test_config_errors_name_the_fields():
  """Rows the axis does not divide, and exact mode (the engine's unsplit
  forward replayed on the trainer), are config-time errors."""
  c = pulse_config()
  length = c.rollout.max_prompt_length + c.rollout.max_new_tokens
  bad = next(n for n in range(2, length + 2) if length % n)
  with pytest.raises(ValueError, match=rf'config\.mesh\.sequence.*{length}'):
    build.build(pulse_config(mesh__sequence=bad))
  good = next(n for n in range(2, length + 1) if length % n == 0)
  assert build.build(pulse_config(mesh__sequence=good)).mesh.sequence == good
  with pytest.raises(ValueError, match=r'config\.rollout\.exact.*sequence'):
    build.build(pulse_config(mesh__sequence=good, rollout__exact=True))


def test_plan_takes_the_sequence_axis():
  """`python -m jaxcorr.plan --mesh=fsdp:2,sequence:4`: the trainer's mesh
  splits rows, the engine's (the trainer's devices) folds the axis."""
  mesh_config, n = presets.parse_mesh('fsdp:2,sequence:4')
  assert (mesh_config.fsdp, mesh_config.sequence, n) == (2, 4, 8)
  config = pulse_config(rollout__max_new_tokens=8)  # rows of 16 tokens
  t = planner.target(
    config, model='', mesh='fsdp:2,sequence:4', engine_devices=0
  )
  assert dict(t.train_mesh.shape) == dict(data=1, fsdp=2, sequence=4, tensor=1)
  assert dict(t.engine_mesh.shape) == dict(data=1, fsdp=8, sequence=1, tensor=1)
  with pytest.raises(ValueError, match=r'config\.mesh\.sequence'):
    planner.target(
      pulse_config(), model='', mesh='sequence:4', engine_devices=0
    )


# ------------------------------------------------------------ mesh rules


def test_sequence_axis_in_the_rules():
  mesh = sh.make_mesh(dict(fsdp=2, sequence=2, tensor=2))
  assert mesh.axis_names == ('data', 'fsdp', 'sequence', 'tensor')

  def spec(axes):
    return sh.logical_to_spec(axes, mesh=mesh)

  assert spec(('batch', 'seq', 'act_embed')) == P(
    ('data', 'fsdp'), 'sequence', None
  )
  assert spec(('embed', 'mlp')) == P(('fsdp', 'sequence'), 'tensor')
  # Size 1: no spec names the axis (shardings as before it existed).
  flat = sh.make_mesh(dict(fsdp=4, tensor=2))
  assert sh.logical_to_spec(('embed', 'seq'), mesh=flat) == P('fsdp', None)


def test_engine_mesh_folds_sequence_into_fsdp():
  mesh = sh.make_mesh(dict(fsdp=2, sequence=2, tensor=2))
  engine = sh.engine_mesh(mesh)
  assert dict(engine.shape) == dict(data=1, fsdp=4, sequence=1, tensor=2)
  # The same device holds the same block of a weight on both meshes.
  w = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
  axes = ('embed', 'mlp')
  a = jax.device_put(w, sh.logical_sharding(axes, mesh, w.shape))
  b = jax.device_put(w, sh.logical_sharding(axes, engine, w.shape))
  blocks = {s.device: np.asarray(s.data) for s in a.addressable_shards}
  for s in b.addressable_shards:
    np.testing.assert_array_equal(blocks[s.device], s.data)
  flat = sh.make_mesh(dict(fsdp=8))
  assert sh.engine_mesh(flat) is flat


@pytest.mark.parametrize('value', [0, -1, 2.0])
def test_sequence_must_be_a_positive_int(value):
  with pytest.raises(ValueError, match='sequence'):
    sh.MeshConfig(sequence=value)
