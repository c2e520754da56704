"""Checkpointer: exact round trips of sharded NNX / optax state, retention,
forced saves, atomicity against crashed saves, resharding on restore."""

from __future__ import annotations

import gc
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxcorr import sharding
from jaxcorr.losses import rewards
from jaxcorr.train.checkpoints import checkpointer as checkpoint
from jaxcorr.train.checkpoints.restore import CheckpointRestoreError
from jaxcorr.train.checkpoints.tree import abstract_like
from jaxcorr.train.state import TrainState
from tests.helpers.model_testing import random_model, tiny_config


@pytest.fixture(scope='module')
def mesh():
  return sharding.make_mesh()  # all 8 devices on `fsdp`


@pytest.fixture(scope='module')
def params(mesh):
  """A tiny Qwen2 `nnx.State`, random values, sharded by the rules table."""
  state = nnx.state(random_model(tiny_config(num_layers=1)), nnx.Param)
  return jax.device_put(state, sharding.param_shardings(state, mesh))


@pytest.fixture(scope='module')
def train_state(params, mesh):
  """A `TrainState` after one real AdamW update (non-zero moments)."""
  tx = optax.adamw(1e-3)
  rep = NamedSharding(mesh, PartitionSpec())

  @jax.jit
  def init_and_update(p):
    opt = tx.init(p)
    grads = jax.tree.map(lambda x: 0.1 * x, p)
    updates, opt = tx.update(grads, opt, p)
    return optax.apply_updates(p, updates), opt

  with jax.set_mesh(mesh):
    new_params, opt_state = init_and_update(params)
  return TrainState(
    params=new_params,
    opt_state=opt_state,
    kl_ctrl=jax.device_put(
      rewards.KLControllerState(coef=jnp.asarray(0.05, jnp.float32)), rep
    ),
    rng=jax.device_put(jax.random.PRNGKey(7), rep),
    updates=jax.device_put(jnp.asarray(1, jnp.int32), rep),
  )


def _small(seed: float = 0.0) -> dict:
  return {'w': jnp.arange(8, dtype=jnp.float32) + seed, 'n': jnp.asarray(3)}


def _assert_same(restored, expected):
  """Same tree (types, Variable metadata), dtypes, shardings, bytes."""
  assert jax.tree.structure(restored) == jax.tree.structure(expected)
  flat_r = jax.tree_util.tree_flatten_with_path(restored)[0]
  flat_e = jax.tree.leaves(expected)
  for (path, r), e in zip(flat_r, flat_e, strict=True):
    where = jax.tree_util.keystr(path)
    assert type(r) is type(e), where
    if isinstance(e, jax.Array):
      assert r.dtype == e.dtype, where
      assert r.sharding.is_equivalent_to(e.sharding, e.ndim), where
      if jax.dtypes.issubdtype(e.dtype, jax.dtypes.prng_key):
        r, e = jax.random.key_data(r), jax.random.key_data(e)
    assert np.asarray(r).tobytes() == np.asarray(e).tobytes(), where


def test_round_trip_is_exact_with_sharded_nnx_and_optax_state(
  tmp_path, train_state, mesh
):
  rep = NamedSharding(mesh, PartitionSpec())
  tree = {
    'state': train_state,
    'ref': train_state.params,
    'typed_key': jax.device_put(jax.random.key(3), rep),
    'bf16': jax.device_put(
      jnp.linspace(-3, 3, 16, dtype=jnp.bfloat16).reshape(8, 2),
      NamedSharding(mesh, PartitionSpec('fsdp')),
    ),
    'host': np.arange(5, dtype=np.int64),
    'none': None,
  }
  meta = {
    'step': 4,
    'loader': {'epoch': 1, 'index': np.int64(17)},
    'config': 'configs/base.py:slime_mis',
    'metrics': {'reward/mean': np.float32(0.5), 'kl': float('nan')},
  }
  with checkpoint.Checkpointer(str(tmp_path), every=1, keep=3) as ckpt:
    assert ckpt.save(4, tree, meta)
    restored, restored_meta = ckpt.restore(abstract_like(tree))

  _assert_same(restored, tree)
  # Params come back as an nnx.State of nnx.Param with their logical axes,
  # and so do the AdamW moments.
  params = restored['state'].params
  assert isinstance(params, nnx.State)
  kernel = params['layers'][0]['mlp']['up_proj']['kernel']
  assert isinstance(kernel, nnx.Param)
  assert kernel.get_metadata()['logical_axes'] == ('embed', 'mlp')
  assert kernel.get_value().sharding.is_equivalent_to(
    NamedSharding(mesh, PartitionSpec('fsdp')), 2
  )
  mu = restored['state'].opt_state[0].mu
  assert isinstance(mu, nnx.State)
  assert float(jnp.abs(jax.tree.leaves(mu)[0]).max()) > 0
  assert restored['none'] is None
  assert isinstance(restored['host'], np.ndarray)

  assert restored_meta['loader'] == {'epoch': 1, 'index': 17}
  assert restored_meta['config'] == 'configs/base.py:slime_mis'
  assert restored_meta['metrics']['reward/mean'] == 0.5
  assert np.isnan(restored_meta['metrics']['kl'])


def test_nnx_state_is_stored_as_pure_dict(tmp_path, params):
  """On disk there is no Variable `value` level: a plain dict target of the
  `nnx.to_pure_dict` form restores the same values."""
  with checkpoint.Checkpointer(str(tmp_path), every=1, keep=1) as ckpt:
    ckpt.save(0, {'params': params}, {})
    pure = nnx.to_pure_dict(params)
    target = {'params': abstract_like(pure)}
    restored, _ = ckpt.restore(target)
  assert not isinstance(restored['params'], nnx.State)
  _assert_same(restored['params'], pure)
  with open(tmp_path / '0' / 'state' / '_METADATA') as f:
    names = json.dumps(json.load(f))
  assert 'up_proj' in names
  assert "'value'" not in names and '"value"' not in names


def test_restore_onto_another_layout(tmp_path, params, mesh):
  """Saved replicated on the fsdp mesh, restored sharded on a 2x2x2 mesh,
  sharded back to replicated, and onto 4 of the 8 devices: same values, the
  target's shardings."""
  rep = NamedSharding(mesh, PartitionSpec())
  replicated = jax.device_put(params, jax.tree.map(lambda _: rep, params))
  other = sharding.make_mesh({'data': 2, 'fsdp': 2, 'tensor': 2})
  target_shardings = sharding.param_shardings(params, other)
  target = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
    params,
    target_shardings,
  )
  with checkpoint.Checkpointer(str(tmp_path), every=1, keep=2) as ckpt:
    ckpt.save(1, replicated, {})
    ckpt.save(2, params, {})
    restored, _ = ckpt.restore(target, step=1)
    back, _ = ckpt.restore(abstract_like(replicated), step=2)
    # Fewer devices: a 4-device fsdp mesh (a smaller slice on resume).
    small = sharding.make_mesh(devices=jax.devices()[:4])
    small_shardings = sharding.param_shardings(params, small)
    on_four, _ = ckpt.restore(
      jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        params,
        small_shardings,
      ),
      step=2,
    )

  _assert_same(on_four, jax.device_put(params, small_shardings))
  expected = jax.device_put(params, target_shardings)
  _assert_same(restored, expected)
  q = restored['layers'][0]['attn']['q_proj']['kernel'].get_value()
  assert q.sharding.is_equivalent_to(
    NamedSharding(other, PartitionSpec('fsdp', 'tensor')), 3
  )
  _assert_same(back, replicated)


def test_every_force_and_keep(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path), every=2, keep=2)
  saved = [s for s in range(8) if ckpt.save(s, _small(s), {'s': s})]
  assert saved == [0, 2, 4, 6]
  assert ckpt.all_steps() == [4, 6]
  assert ckpt.save(7, _small(7), {'s': 7}, force=True)
  assert ckpt.all_steps() == [6, 7]
  assert sorted(os.listdir(tmp_path)) == ['6', '7']
  # An existing step is never overwritten.
  assert not ckpt.save(7, _small(99), {'s': 99}, force=True)
  state, meta = ckpt.restore(abstract_like(_small()))
  assert meta == {'s': 7}
  np.testing.assert_array_equal(state['w'], _small(7)['w'])
  ckpt.close()

  never = checkpoint.Checkpointer(str(tmp_path / 'never'), every=0, keep=1)
  assert not any(never.should_save(s) for s in range(5))
  assert not never.save(3, _small(), {})
  assert never.latest_step() is None
  assert never.save(3, _small(), {}, force=True)
  assert never.latest_step() == 3
  never.close()


def test_restore_latest_or_given_step(tmp_path):
  with checkpoint.Checkpointer(str(tmp_path), every=1, keep=5) as ckpt:
    with pytest.raises(FileNotFoundError, match='no checkpoint'):
      ckpt.restore(abstract_like(_small()))
    for s in (3, 5, 9):
      ckpt.save(s, _small(s), {'s': s})
    assert ckpt.latest_step() == 9
    target = abstract_like(_small())
    state, meta = ckpt.restore(target)
    assert meta['s'] == 9
    np.testing.assert_array_equal(state['w'], _small(9)['w'])
    state, meta = ckpt.restore(target, step=5)
    assert meta['s'] == 5
    np.testing.assert_array_equal(state['w'], _small(5)['w'])
    with pytest.raises(FileNotFoundError, match=r'step 4 .*\[3, 5, 9\]'):
      ckpt.restore(target, step=4)


def test_crashed_save_is_ignored_and_redone(tmp_path):
  """A save killed mid-write leaves only `<step>.orbax-checkpoint-tmp*`:
  never reported, the previous step restores, and the step saves again."""
  with checkpoint.Checkpointer(str(tmp_path), every=1, keep=3) as ckpt:
    ckpt.save(1, _small(1), {'s': 1})
    ckpt.save(2, _small(2), {'s': 2})
  partial = tmp_path / '3.orbax-checkpoint-tmp'
  (partial / 'state').mkdir(parents=True)
  (partial / 'state' / 'manifest.ocdbt').write_bytes(b'\x00' * 10)
  (partial / 'meta').mkdir()

  ckpt = checkpoint.Checkpointer(str(tmp_path), every=1, keep=3)
  assert ckpt.latest_step() == 2
  assert ckpt.all_steps() == [1, 2]
  state, meta = ckpt.restore(abstract_like(_small()))
  assert meta == {'s': 2}
  np.testing.assert_array_equal(state['w'], _small(2)['w'])
  # The resumed run reaches step 3 again and saves it over the debris.
  assert ckpt.save(3, _small(3), {'s': 3})
  assert ckpt.latest_step() == 3
  state, meta = ckpt.restore(abstract_like(_small()))
  assert meta == {'s': 3}
  np.testing.assert_array_equal(state['w'], _small(3)['w'])
  ckpt.close()
  assert not [p for p in os.listdir(tmp_path) if 'tmp' in p]

  # A temporary directory that appears while a Checkpointer is open (an
  # in-flight save of another process) is not reported either.
  with checkpoint.Checkpointer(str(tmp_path), every=1, keep=3) as ckpt:
    (tmp_path / '8.orbax-checkpoint-tmp' / 'state').mkdir(parents=True)
    assert ckpt.latest_step() == 3


def test_async_save_copies_before_returning(tmp_path, mesh):
  """With async_save the caller may delete (donate) its arrays as soon as
  `save` returns; `wait` commits."""
  x = jax.device_put(
    jnp.arange(64, dtype=jnp.float32).reshape(8, 8),
    NamedSharding(mesh, PartitionSpec('fsdp')),
  )
  expected = np.asarray(x)
  target = abstract_like({'x': x})
  with checkpoint.Checkpointer(
    str(tmp_path), every=1, keep=1, async_save=True
  ) as ckpt:
    assert ckpt.save(0, {'x': x}, {'a': 1})
    x.delete()
    ckpt.wait()
    assert ckpt.latest_step() == 0
    state, meta = ckpt.restore(target)
  np.testing.assert_array_equal(np.asarray(state['x']), expected)
  assert meta == {'a': 1}


def test_invalid_arguments(tmp_path):
  with pytest.raises(ValueError, match='keep must be an int >= 1, got 0'):
    checkpoint.Checkpointer(str(tmp_path), every=1, keep=0)
  with pytest.raises(ValueError, match='every must be an int'):
    checkpoint.Checkpointer(str(tmp_path), every=1.5, keep=1)
  ckpt = checkpoint.Checkpointer(str(tmp_path), every=1, keep=1)
  with pytest.raises(ValueError, match=r"meta\['loader'\]\['fn'\] of type"):
    ckpt.save(0, _small(), {'loader': {'fn': print}})
  with pytest.raises(ValueError, match='step must be >= 0'):
    ckpt.save(-1, _small(), {})
  assert ckpt.latest_step() is None
  ckpt.save(0, _small(), {})
  no_sharding = {'w': jax.ShapeDtypeStruct((8,), jnp.float32), 'n': 0}
  with pytest.raises(ValueError, match=r"\['w'\] is a ShapeDtypeStruct"):
    ckpt.restore(no_sharding)
  with pytest.raises(
    ValueError, match=r'(?s)restoring checkpoint step 0 .*extra'
  ):
    ckpt.restore(abstract_like({**_small(), 'extra': _small()['w']}))
  ckpt.close()
  with pytest.raises(ValueError, match='is closed'):
    ckpt.save(1, _small(), {}, force=True)


def _data_files(step_dir):
  return [
    p for p in step_dir.rglob('*') if p.is_file() and p.parent.name == 'd'
  ]


DAMAGES = {
  'truncated data': lambda d: [
    os.truncate(p, 10) for p in _data_files(d / 'state')
  ],
  'missing manifest': lambda d: [
    p.unlink() for p in (d / 'state').rglob('manifest.ocdbt')
  ],
  'truncated array metadata': lambda d: os.truncate(d / 'state/_METADATA', 5),
  'missing meta': lambda d: (d / 'meta' / 'metadata').unlink(),
  'truncated meta': lambda d: os.truncate(d / 'meta' / 'metadata', 3),
}


@pytest.mark.parametrize('damage', sorted(DAMAGES))
def test_unreadable_latest_step_falls_back_to_the_newest_intact(
  tmp_path, damage, caplog
):
  """Files Orbax wrote, damaged as a crash or a full disk would: the
  restore reports it in one line, takes the previous step, and the resumed
  run can save the damaged step again."""
  with checkpoint.Checkpointer(str(tmp_path), every=1, keep=3) as ckpt:
    for s in (1, 2, 3):
      ckpt.save(s, _small(s), {'s': s})
  DAMAGES[damage](tmp_path / '3')
  with checkpoint.Checkpointer(str(tmp_path), every=1, keep=3) as ckpt:
    state, meta = ckpt.restore(abstract_like(_small()))
    assert meta == {'s': 2}
    np.testing.assert_array_equal(state['w'], _small(2)['w'])
    assert ckpt.all_steps() == [1, 2]
    assert (tmp_path / '3.unreadable').is_dir()  # kept for inspection
    assert ckpt.save(3, _small(30), {'s': 30})
    state, meta = ckpt.restore(abstract_like(_small()))
    assert meta == {'s': 30}
  warnings = [
    r.getMessage() for r in caplog.records if r.levelname == 'WARNING'
  ]
  bad = [m for m in warnings if 'restoring checkpoint step 3' in m]
  assert len(bad) == 1 and '\n' not in bad[0] and len(bad[0]) < 600, bad


def test_no_readable_step_is_one_line_error_and_renames_nothing(tmp_path):
  with checkpoint.Checkpointer(str(tmp_path), every=1, keep=3) as ckpt:
    for s in (1, 2):
      ckpt.save(s, _small(s), {'s': s})
  for s in ('1', '2'):
    DAMAGES['truncated data'](tmp_path / s)
  with checkpoint.Checkpointer(str(tmp_path), every=1, keep=3) as ckpt:
    with pytest.raises(CheckpointRestoreError) as info:
      ckpt.restore(abstract_like(_small()))
    assert ckpt.all_steps() == [1, 2]
  msg = str(info.value)
  assert msg.startswith('restoring checkpoint step 2 ')
  assert msg.endswith('(and every older step: [1])')
  assert '\n' not in msg and len(msg) < 600
  # No chained TensorStore traceback is printed under it.
  err = info.value
  assert err.__cause__ is None
  assert err.__context__ is None or err.__suppress_context__


ROOT = str(pathlib.Path(__file__).resolve().parents[3])
_CONSOLE_SCRIPT = """
import gc, os, pathlib, sys, time
import jax.numpy as jnp
from jaxcorr.train.checkpoints import checkpointer as checkpoint
from jaxcorr.train.checkpoints.tree import abstract_like
d = pathlib.Path(sys.argv[1])
small = lambda s=0: {'w': jnp.arange(8.0) + s, 'v': [jnp.ones((4, 4)) * s, s]}
with checkpoint.Checkpointer(str(d), every=1, keep=3) as ckpt:
  for s in (1, 2, 3):
    ckpt.save(s, small(s), {'s': s})
for s in sys.argv[2:]:
  for p in (d / s / 'state').rglob('*'):
    if p.is_file() and p.parent.name == 'd':
      os.truncate(p, 10)
with checkpoint.Checkpointer(str(d), every=1, keep=3) as ckpt:
  print('restored', ckpt.restore(abstract_like(small()))[1])
time.sleep(0.5)  # reads still in flight finish, their leftovers are freed
gc.collect()
"""


@pytest.mark.parametrize('damaged', [['3'], ['1', '2', '3']])
def test_console_shows_one_line_per_unreadable_step(tmp_path, damaged):
  """What a user sees: the one-line messages and nothing else. Orbax's
  other failed read tasks used to be logged by asyncio at the next garbage
  collection or at exit ("Task exception was never retrieved", each with
  its TensorStore spec: hundreds of lines for a tiny model)."""
  proc = subprocess.run(
    [sys.executable, '-c', _CONSOLE_SCRIPT, str(tmp_path), *damaged],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
  )
  out = proc.stdout + proc.stderr
  assert 'never retrieved' not in out and 'never awaited' not in out, out
  assert 'Event loop is closed' not in out, out
  if len(damaged) == 1:
    assert proc.returncode == 0 and "restored {'s': 2}" in out, out
    assert 'Traceback' not in out, out
    lines = [line for line in out.splitlines() if 'restor' in line]
    assert len(lines) == 3, lines  # step 3 unreadable, step 2, the print
  else:
    assert proc.returncode == 1, out
    assert out.count('Traceback') == 1, out
    last = out.splitlines()[-1]
    err = CheckpointRestoreError
    want = f'{err.__module__}.{err.__qualname__}: restoring checkpoint step 3'
    assert last.startswith(want), out


def test_leftovers_of_a_failed_restore_are_dropped_and_nothing_else(caplog):
  """The filters `discard_leftovers` installs: asyncio's never-retrieved
  records of TensorStore errors and unraisable closed-loop errors go,
  other never-retrieved records and unraisables stay."""
  import asyncio
  import types

  from jaxcorr.train.checkpoints import failed_restore

  failed_restore.discard_leftovers(ValueError('a failed restore'))

  def unretrieved(message):
    loop = asyncio.new_event_loop()
    future = loop.create_future()
    future.set_exception(ValueError(message))
    del future
    gc.collect()
    loop.close()

  caplog.clear()
  unretrieved('OUT_OF_RANGE: ... [tensorstore_spec=...]')
  assert not [r for r in caplog.records if r.name == 'asyncio']
  unretrieved('a user bug')
  assert [r for r in caplog.records if r.name == 'asyncio']
  seen = []
  previous, sys.unraisablehook = sys.unraisablehook, seen.append
  try:
    failed_restore._installed = False  # its hook goes over `seen`
    failed_restore.discard_leftovers(ValueError('a failed restore'))
    for exc in (RuntimeError('Event loop is closed'), RuntimeError('other')):
      sys.unraisablehook(
        types.SimpleNamespace(exc_value=exc, object=None, exc_type=None)
      )
  finally:
    sys.unraisablehook = previous
  assert [str(u.exc_value) for u in seen] == ['other']


def test_save_on_a_full_disk_is_one_line_naming_the_workdir(
  tmp_path, monkeypatch, caplog
):
  """ENOSPC injected into the save: one `DiskFull` line naming the workdir
  and its free space, and orbax's copies of the error (logged from its
  writer threads before the save raises) left off the console."""
  import errno

  import orbax.checkpoint as ocp
  from absl import logging as absl_logging

  from configs import arith_tiny
  from jaxcorr.train import build
  from jaxcorr.train.checkpoints.disk_full import DiskFull
  from jaxcorr.train.checkpoints.resume import Progress, RunCheckpoints

  run = build.build(arith_tiny.get_config('pulse'))
  workdir = str(tmp_path / 'run')
  ckpts = RunCheckpoints(workdir, run, 'pulse')
  ckpts.save(Progress(0), _small(), None, force=True)
  no_space = os.strerror(errno.ENOSPC)

  def full(*args, **kwargs):
    # What orbax logs from each writer thread, then raises.
    absl_logging.error('_SignalingThread.run() raised: %s', no_space)
    raise OSError(errno.ENOSPC, no_space, f'{workdir}/checkpoints/3')

  monkeypatch.setattr(ocp.CheckpointManager, 'save', full)
  with pytest.raises(DiskFull) as e:
    ckpts.save(Progress(3), _small(), None, force=True)
  msg = str(e.value)
  assert '\n' not in msg and e.value.__cause__ is None
  assert msg.startswith(
    f'checkpoint step 3 not written: no space left on the device of {workdir} ('
  )
  assert ' free); ' in msg and msg.endswith('resume from step 0')
  assert not [r for r in caplog.records if no_space in r.getMessage()]
  # Any other failure is left as it is.
  monkeypatch.setattr(ocp.CheckpointManager, 'save', lambda *a, **k: 1 / 0)
  with pytest.raises(ZeroDivisionError):
    ckpts.save(Progress(4), _small(), None, force=True)
  ckpts.checkpointer.close()
