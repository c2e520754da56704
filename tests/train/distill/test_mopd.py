"""Multi-teacher distillation (MOPD): two tiny teachers saved by 0-step
runs (inits 0 and 1), a student of configs/arith_mopd_tiny.py (ops '+*':
tasks add and mul) with `distill.teachers='add=...,mul=...'`.

Each row's distillation advantage is the reverse KL against its routed
teacher, computed here independently (each teacher's own forward over
every row); routing mistakes are config-time errors; and in the whole
trainer loop (slow) a student equal to the add teacher sees zero KL on
the add rows only."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from configs import arith_mopd_tiny
from jaxcorr.train import batch as batch_lib
from jaxcorr.train import build
from jaxcorr.train.distill import score
from jaxcorr.train.distill import teacher as distill_teacher
from jaxcorr.train.loop import Trainer
from jaxcorr.train.prepare import prepare
from tests.helpers.step_batches import one_device_mesh, step_arrays
from tests.helpers.trainer_config import pulse_config

NAMES = ('add', 'mul')


@pytest.fixture(scope='module')
def teachers(tmp_path_factory):
  out = {}
  for seed, name in enumerate(NAMES):
    path = tmp_path_factory.mktemp(name)
    config = pulse_config(
      train__num_steps=0,
      train__sft_steps=0,
      train__eval_every=0,
      model__init_seed=seed,
    )
    Trainer.from_config(config, str(path), config_name='test').train()
    out[name] = str(path)
  return out


def _student(teachers, **distill):
  config = arith_mopd_tiny.get_config('pulse')
  assert config.data.ops == '+*'
  config.distill.teachers = ','.join(f'{k}={v}' for k, v in teachers.items())
  for key, value in distill.items():
    config.distill[key] = value
  config.train.eval_every = 0
  return config


def test_each_row_distils_from_its_routed_teacher(teachers):
  """`prepare` on a synthetic batch of both tasks (and one row of no
  task), the student being the add teacher (init 0) itself."""
  run = build.build(_student(teachers))
  mesh = one_device_mesh()
  routed = distill_teacher.for_run(run, mesh)
  assert routed.names == NAMES and routed.route == (0, 1)
  student = routed.members[0]
  task = np.asarray([0, 0, 0, -1, 1, 1, 1, 1], np.int32)  # -1: no task

  @jax.jit
  def prepared(batch, teachers):
    return prepare(
      run, student.graphdef, None, student.params, None, None, None, batch,
      teacher=teachers,
    )  # fmt: skip

  @jax.jit
  def alone(batch, t):
    return score.teacher_logp(run, t.graphdef, t.params, batch, engine=False)

  with jax.set_mesh(mesh):
    batch = batch_lib.to_device(mesh, step_arrays(run, 1).replace(task_id=task))
    _, out, metrics = prepared(batch, routed)
    kl = [out.old_logp - alone(batch, t) for t in routed.members]
  mask = np.asarray(batch.response_mask)
  kl = [np.where(mask, k, 0) for k in kl]
  want = -np.select([(task == 0)[:, None], (task == 1)[:, None]], kl, 0)
  np.testing.assert_allclose(out.advantages, want, atol=1e-5)
  np.testing.assert_allclose(kl[0], 0, atol=1e-6)  # the student's own rows
  assert np.abs(kl[1])[mask].max() > 1e-3  # the mul teacher differs
  for k, name in enumerate(NAMES):
    rows = mask & (task == k)[:, None]
    np.testing.assert_allclose(
      metrics[f'distill/{name}/reverse_kl'], kl[k][rows].mean(), atol=1e-6
    )
    assert metrics[f'distill/{name}/rows'] == (task == k).sum()
  assert metrics['distill/untaught_rows'] == 1
  np.testing.assert_array_equal(out.advantages[3], 0.0)


def test_routing_errors_at_config_time(teachers):
  one = _student({'add': teachers['add']})
  with pytest.raises(ValueError, match=r"distill\.routes.*no teacher.*'mul'"):
    build.build(one)
  config = _student(teachers)
  config.data.ops = '+-'
  with pytest.raises(ValueError, match=r"routes.*no teacher for.*'sub'"):
    build.build(config)
  with pytest.raises(ValueError, match=r'routes.*no task.*mul'):
    build.build(_student(teachers, routes='add:add,mul:add'))
  with pytest.raises(ValueError, match=r'distill\.teachers.*teacher is set'):
    build.build(_student(teachers, teacher=teachers['add']))
  with pytest.raises(ValueError, match=r'distill\.routes.*bad entry add:x'):
    build.build(_student(teachers, routes='add:x'))
  with pytest.raises(ValueError, match=r'distill\.loss.*teachers'):
    build.build(_student(teachers, loss='topk_kl'))


def test_teacher_with_another_vocabulary_is_named(teachers, tmp_path):
  other = tmp_path / 'wide'
  config = pulse_config(
    train__num_steps=0, train__sft_steps=0, train__eval_every=0
  )
  config.model.vocab_size = 64
  other.mkdir()
  (other / 'checkpoints').mkdir()
  (other / 'config.json').write_text(config.to_json())
  bad = _student({'add': teachers['add'], 'mul': str(other)})
  with pytest.raises(ValueError, match=r'teachers\[mul\].*vocabulary') as e:
    build.build(bad)
  assert '\n' not in str(e.value)


LOOPS = {
  'sync': {},
  # The ids through the async queue, packing and dynamic sampling's picks
  # (an untrained student never varies: every group is dropped, refilled).
  'async_packed_dynamic': {
    'rollout.mode': 'async',
    'rollout.max_staleness': 1,
    'train.packing': True,
    'dynamic_sampling.enabled': True,
    'dynamic_sampling.max_gen_rounds': 2,
    'dynamic_sampling.at_cap': 'fill_dropped',
  },
}


@pytest.mark.slow  # ~40 s each; CI covers routing, task ids and errors above
@pytest.mark.parametrize('loop', list(LOOPS))
def test_trainer_loop_routes_rows_by_task(teachers, tmp_path, loop):
  """The student starts as the add teacher (init 0): at step 1 the add
  rows' reverse KL is 0 (teacher = π_old), the mul rows' is not."""
  config = _student(teachers)
  config.train.num_steps = 1
  for path, value in LOOPS[loop].items():
    section, field = path.split('.')
    config[section][field] = value
  Trainer.from_config(config, str(tmp_path / 's'), config_name='t').train()
  with open(tmp_path / 's' / 'metrics.jsonl') as f:
    row = next(json.loads(x) for x in f if '"step": 1' in x)
  assert row['distill/add/rows'] > 0 and row['distill/mul/rows'] > 0
  # 0 up to the packed π_old pass's rounding (exactly 0 unpacked).
  assert abs(row['distill/add/reverse_kl']) < 1e-6
  assert row['distill/mul/reverse_kl'] > 1e-3
