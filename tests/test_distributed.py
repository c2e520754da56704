"""jaxcorr.distributed: argument validation, cluster detection, flags, and a
real two-process CPU job (gloo collectives, one global 8-device mesh)."""

from __future__ import annotations

import textwrap

import jax
import pytest
from absl import flags

from jaxcorr import distributed
from tests.helpers import process_group


@pytest.fixture
def calls(monkeypatch):
  """Record jax.distributed.initialize / the collectives config instead of
  running them (this pytest process already has a backend)."""
  rec = {'init': [], 'collectives': []}
  monkeypatch.setattr(distributed, '_initialized', False)
  monkeypatch.setattr(jax.distributed, 'is_initialized', lambda: False)
  monkeypatch.setattr(
    jax.distributed, 'initialize', lambda **kw: rec['init'].append(kw)
  )
  monkeypatch.setattr(
    distributed, '_set_cpu_collectives', rec['collectives'].append
  )
  monkeypatch.setattr(distributed, 'process_info', dict)
  monkeypatch.setattr(distributed, '_tpu_chips_present', lambda: False)
  for name in (
    distributed.ENV_SWITCH,
    'MEGASCALE_COORDINATOR_ADDRESS',
    'MEGASCALE_NUM_SLICES',
    'TPU_WORKER_HOSTNAMES',
    'TPU_PROCESS_ADDRESSES',
    'CLOUD_TPU_TASK_ID',
    'TPU_SKIP_MDS_QUERY',
  ):
    monkeypatch.delenv(name, raising=False)
  return rec


# -------------------------------------------------------------- validation


@pytest.mark.parametrize(
  'kwargs, missing',
  [
    (
      dict(coordinator_address='localhost:1234'),
      '--num_processes, --process_id',
    ),
    (dict(num_processes=2), '--coordinator_address, --process_id'),
    (dict(process_id=0, num_processes=2), '--coordinator_address'),
    (dict(coordinator_address='h:1', process_id=1), '--num_processes'),
  ],
)
def test_explicit_arguments_go_together(calls, kwargs, missing):
  with pytest.raises(ValueError, match=f'given together.*missing: {missing}$'):
    distributed.initialize(**kwargs)
  assert calls['init'] == []


@pytest.mark.parametrize(
  'kwargs, match',
  [
    (dict(coordinator_address='localhost'), '--coordinator_address.*host:port'),
    (dict(coordinator_address=':80'), '--coordinator_address'),
    (dict(coordinator_address='h:99999'), '--coordinator_address'),
    (dict(num_processes=0), '--num_processes: invalid value 0'),
    (dict(num_processes=2.0), '--num_processes: invalid value 2.0'),
    (dict(process_id=2), r'--process_id: invalid value 2.*0\.\.1'),
    (dict(process_id=-1), '--process_id: invalid value -1'),
    (dict(cpu_collectives='nccl'), '--cpu_collectives.*allowed: gloo, mpi'),
    (dict(local_device_ids=[0, -1]), 'local_device_ids'),
  ],
)
def test_invalid_values_name_the_flag(calls, kwargs, match):
  args = dict(coordinator_address='localhost:1234', num_processes=2)
  args['process_id'] = 0
  with pytest.raises(ValueError, match=match):
    distributed.initialize(**{**args, **kwargs})
  assert calls['init'] == []


def test_explicit_initializes_with_gloo_and_only_once(calls):
  distributed.initialize(
    coordinator_address='10.0.0.1:8476',
    num_processes=4,
    process_id=3,
    local_device_ids=(0, 1),
  )
  distributed.initialize(
    coordinator_address='10.0.0.1:8476', num_processes=4, process_id=3
  )
  assert calls['init'] == [
    dict(
      coordinator_address='10.0.0.1:8476',
      num_processes=4,
      process_id=3,
      local_device_ids=[0, 1],
    )
  ]
  assert calls['collectives'] == ['gloo']


def test_cpu_collectives_choice_is_passed(calls):
  distributed.initialize(
    coordinator_address='h:1',
    num_processes=1,
    process_id=0,
    cpu_collectives='mpi',
  )
  assert calls['collectives'] == ['mpi']


def test_single_process_is_a_no_op(calls):
  distributed.initialize()
  distributed.initialize()
  assert calls == {'init': [], 'collectives': []}


def test_already_initialized_jax_is_left_alone(calls, monkeypatch):
  monkeypatch.setattr(jax.distributed, 'is_initialized', lambda: True)
  distributed.initialize(
    coordinator_address='h:1', num_processes=2, process_id=0
  )
  assert calls['init'] == []


# --------------------------------------------------------------- detection


@pytest.mark.parametrize(
  'env, expected',
  [
    ({}, None),
    ({'JAXCORR_DISTRIBUTED': 'auto'}, 'JAXCORR_DISTRIBUTED=auto'),
    ({'JAXCORR_DISTRIBUTED': 'off', 'TPU_WORKER_HOSTNAMES': 'a,b'}, None),
    ({'MEGASCALE_COORDINATOR_ADDRESS': '10.0.0.2:8080'}, 'multislice'),
    ({'MEGASCALE_NUM_SLICES': '2'}, 'MEGASCALE_NUM_SLICES=2'),
    ({'MEGASCALE_NUM_SLICES': '1'}, None),
    ({'TPU_WORKER_HOSTNAMES': 'w-0,w-1,w-2,w-3'}, 'lists 4 hosts'),
    ({'TPU_WORKER_HOSTNAMES': 'w-0'}, None),
    ({'TPU_PROCESS_ADDRESSES': 'a:8471,b:8471'}, 'TPU_PROCESS_ADDRESSES'),
    ({'CLOUD_TPU_TASK_ID': '0'}, 'CLOUD_TPU_TASK_ID'),
  ],
)
def test_detect_cluster_from_environment(calls, env, expected):
  reason = distributed.detect_cluster(env)
  if expected is None:
    assert reason is None
  else:
    assert expected in reason


def test_detect_cluster_rejects_a_bad_switch(calls):
  with pytest.raises(ValueError, match=r'JAXCORR_DISTRIBUTED.*auto, off'):
    distributed.detect_cluster({'JAXCORR_DISTRIBUTED': 'yes'})


@pytest.mark.parametrize(
  'workers, env, expected',
  [
    (4, {}, 'metadata lists 4 workers'),
    (1, {}, None),
    (None, {}, None),  # metadata server unreachable
    (4, {'TPU_SKIP_MDS_QUERY': '1'}, None),
  ],
)
def test_detect_gce_tpu_slice_from_metadata(
  calls, monkeypatch, workers, env, expected
):
  monkeypatch.setattr(distributed, '_tpu_chips_present', lambda: True)
  monkeypatch.setattr(distributed, '_gce_tpu_workers', lambda: workers)
  reason = distributed.detect_cluster(env)
  assert reason == expected if expected is None else expected in reason


def test_no_metadata_probe_without_tpu_chips(calls, monkeypatch):
  def probe():
    raise AssertionError('metadata probed on a machine without TPU chips')

  monkeypatch.setattr(distributed, '_gce_tpu_workers', probe)
  assert distributed.detect_cluster({}) is None


def test_detected_cluster_initializes_without_arguments(calls, monkeypatch):
  monkeypatch.setenv('TPU_WORKER_HOSTNAMES', 'w-0,w-1')
  distributed.initialize()
  assert calls['init'] == [{}]
  assert calls['collectives'] == ['gloo']


# ------------------------------------------------------------------- flags


def test_flags_define_once_and_feed_initialize(calls):
  fv = flags.FlagValues()
  distributed.define_flags(fv)
  distributed.define_flags(fv)  # idempotent
  fv(
    [
      'prog',
      '--coordinator_address=10.0.0.1:1234',
      '--num_processes=2',
      '--process_id=1',
      '--cpu_collectives=gloo',
    ]
  )
  distributed.initialize_from_flags(fv)
  assert calls['init'] == [
    dict(coordinator_address='10.0.0.1:1234', num_processes=2, process_id=1)
  ]


def test_flags_default_to_single_process(calls):
  fv = flags.FlagValues()
  distributed.define_flags(fv)
  fv(['prog'])
  distributed.initialize_from_flags(fv)
  assert calls['init'] == []


def test_flags_partial_explicit_is_an_error(calls):
  fv = flags.FlagValues()
  distributed.define_flags(fv)
  fv(['prog', '--num_processes=2'])
  with pytest.raises(ValueError, match='missing: --coordinator_address'):
    distributed.initialize_from_flags(fv)


# ------------------------------------------------------ two real processes

_CHILD = textwrap.dedent(
  """
  import sys

  import jax

  jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_num_cpu_devices', 4)

  from jaxcorr import distributed

  pid, port = int(sys.argv[1]), sys.argv[2]
  distributed.initialize(
    coordinator_address=f'localhost:{port}', num_processes=2, process_id=pid
  )
  distributed.initialize()  # a second call is a no-op

  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  info = distributed.process_info()
  assert info['process_index'] == pid, info
  assert info['process_count'] == 2, info
  assert info['local_device_count'] == 4, info
  assert info['device_count'] == 8, info
  assert jax.config.jax_cpu_collectives_implementation == 'gloo'

  mesh = jax.make_mesh((8,), ('data',), devices=jax.devices())
  sharding = NamedSharding(mesh, P('data'))
  # Rows 8 * pid .. 8 * pid + 7 of arange(32).reshape(16, 2): each process
  # holds only its half of the global [16, 2] array.
  local = np.arange(16 * pid, 16 * pid + 16, dtype=np.float32).reshape(8, 2)
  x = jax.make_array_from_process_local_data(sharding, local, (16, 2))
  assert x.shape == (16, 2)
  total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
  print(f'RESULT {pid} {float(total):.1f}', flush=True)
  """
)


def test_two_process_cpu_job_sums_a_global_array(tmp_path):
  script = tmp_path / 'child.py'
  script.write_text(_CHILD)
  port = str(process_group.free_port())
  results = process_group.run_group(
    [[str(script), str(pid), port] for pid in range(2)],
    env=process_group.clean_env(),
    timeout_s=120,
  )
  expected = float(sum(range(32)))  # 496
  for pid, (code, out) in enumerate(results):
    assert code == 0, f'process {pid} failed:\n{out}'
    assert f'RESULT {pid} {expected:.1f}' in out, out
