"""Multi-process start-up: one call, before any JAX computation.

JAX is multi-controller: on a TPU pod slice every host runs the same Python
program, and the processes must find each other through
`jax.distributed.initialize` before the XLA backend starts (the first
`jax.devices()`, `device_put` or computation); only then do `jax.devices()`
list the global devices, a mesh span every host, and Orbax checkpoint as
one. `initialize` makes that one decision for `jaxcorr.main`:

1. Explicit (generic clusters, the CPU multi-process tests):
   `--coordinator_address`, `--num_processes` and `--process_id` together
   are passed to `jax.distributed.initialize` as they are.
2. Detected: the environment says this process is one of several (table
   below). `jax.distributed.initialize()` is then called with no arguments,
   and JAX finds the coordinator, process count and id itself (from the GCE
   metadata server on TPU VMs, from the environment on GKE and multislice).
3. Otherwise a single process: nothing to do (`jax.process_count() == 1`).

Signals of a multi-process TPU job, checked in this order:

| signal | where it comes from |
|---|---|
| `JAXCORR_DISTRIBUTED=auto` / `off` | `launch_tpu.sh` (every worker) or you; forces detection on / off |
| `MEGASCALE_COORDINATOR_ADDRESS`, `MEGASCALE_NUM_SLICES` > 1 | multislice (queued resources, GKE JobSet) |
| `TPU_WORKER_HOSTNAMES` / `TPU_PROCESS_ADDRESSES` listing > 1 host | GKE TPU node pools |
| `CLOUD_TPU_TASK_ID` | older TPU pod runtimes |
| `worker-network-endpoints` metadata listing > 1 host | a GCE TPU VM slice (`gcloud compute tpus tpu-vm create`), probed only when TPU chips are present (`/dev/accel*`, `/dev/vfio/N`) |

A plain GCE TPU VM puts nothing in the process environment: the slice is
described by the metadata server, which is what JAX itself reads, hence the
last row. `JAXCORR_DISTRIBUTED=auto` also lets JAX auto-detect Slurm and
Open MPI jobs.

CPU multi-process runs need a cross-process collectives implementation;
`initialize` sets `jax_cpu_collectives_implementation` (`--cpu_collectives`,
default `gloo`) before initializing. gloo is also the default of JAX 0.10;
setting it explicitly keeps a `JAX_CPU_COLLECTIVES_IMPLEMENTATION` left in
the environment or another JAX version from leaving CPU collectives off.
"""

from __future__ import annotations

import glob
import os
import socket
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from absl import flags, logging

CPU_COLLECTIVES = ('gloo', 'mpi')
"""Values of `--cpu_collectives` (`jax_cpu_collectives_implementation`)."""

ENV_SWITCH = 'JAXCORR_DISTRIBUTED'
"""Environment variable forcing detection: 'auto' (initialize with no
arguments, let JAX find the cluster) or 'off' (never initialize from the
environment; explicit flags still apply)."""

_SWITCH_VALUES = ('auto', 'off')
_EXPLICIT = ('coordinator_address', 'num_processes', 'process_id')
_METADATA_URL = (
  'http://metadata.google.internal/computeMetadata/v1/instance/attributes/'
)
_METADATA_TIMEOUT_S = 2.0

_initialized = False


# --------------------------------------------------------------- detection


def _hosts(value: str | None) -> int:
  return len([h for h in (value or '').split(',') if h.strip()])


def _tpu_chips_present() -> bool:
  """TPU chips on this VM: /dev/accel* (v2-v4) or /dev/vfio/N (v5e and on)."""
  return bool(glob.glob('/dev/accel*') or glob.glob('/dev/vfio/[0-9]*'))


def _gce_tpu_workers() -> int | None:
  """Hosts in this GCE TPU slice per the metadata server; None if unknown."""
  request = urllib.request.Request(
    _METADATA_URL + 'worker-network-endpoints',
    headers={'Metadata-Flavor': 'Google'},
  )
  try:
    with urllib.request.urlopen(request, timeout=_METADATA_TIMEOUT_S) as r:
      return _hosts(r.read().decode())
  except (OSError, ValueError):
    return None


def detect_cluster(environ: Mapping[str, str] | None = None) -> str | None:
  """Why this process looks like one of several, or None (single process).

  The returned string names the signal (module docstring table) for logs.
  """
  env = os.environ if environ is None else environ
  switch = env.get(ENV_SWITCH, '').strip().lower()
  if switch and switch not in _SWITCH_VALUES:
    raise ValueError(
      f'{ENV_SWITCH}: invalid value {env[ENV_SWITCH]!r}; allowed: '
      f'{", ".join(_SWITCH_VALUES)} or unset'
    )
  if switch == 'off':
    return None
  if switch == 'auto':
    return f'{ENV_SWITCH}=auto'
  if env.get('MEGASCALE_COORDINATOR_ADDRESS'):
    return 'MEGASCALE_COORDINATOR_ADDRESS is set (multislice)'
  slices = env.get('MEGASCALE_NUM_SLICES', '').strip()
  if slices.isdigit() and int(slices) > 1:
    return f'MEGASCALE_NUM_SLICES={slices} (multislice)'
  for name in ('TPU_WORKER_HOSTNAMES', 'TPU_PROCESS_ADDRESSES'):
    n = _hosts(env.get(name))
    if n > 1:
      return f'{name} lists {n} hosts'
  if env.get('CLOUD_TPU_TASK_ID'):
    return 'CLOUD_TPU_TASK_ID is set'
  if _tpu_chips_present() and not env.get('TPU_SKIP_MDS_QUERY'):
    n = _gce_tpu_workers()
    if n is not None and n > 1:
      return f'TPU VM metadata lists {n} workers'
  return None


# -------------------------------------------------------------- initialize


def _check_explicit(
  coordinator_address: str, num_processes: int, process_id: int
) -> None:
  host, _, port = str(coordinator_address).rpartition(':')
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(
      f'--coordinator_address: invalid value {coordinator_address!r}; '
      "allowed: 'host:port' with a port in 1..65535 (e.g. 10.0.0.1:8476)"
    )
  if (
    isinstance(num_processes, bool)
    or not isinstance(num_processes, int)
    or num_processes < 1
  ):
    raise ValueError(
      f'--num_processes: invalid value {num_processes!r}; allowed: an '
      'integer >= 1'
    )
  if (
    isinstance(process_id, bool)
    or not isinstance(process_id, int)
    or not 0 <= process_id < num_processes
  ):
    raise ValueError(
      f'--process_id: invalid value {process_id!r}; allowed: an integer '
      f'in 0..{num_processes - 1} (--num_processes={num_processes})'
    )


def _set_cpu_collectives(name: str) -> None:
  jax.config.update('jax_cpu_collectives_implementation', name)


def initialize(
  *,
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  local_device_ids: Sequence[int] | None = None,
  cpu_collectives: str | None = None,
) -> None:
  """Start `jax.distributed` when this is one of several processes.

  Call it first thing, before any JAX computation or `jax.devices()`. With
  the three explicit arguments it initializes with them; with none it
  initializes with no arguments (JAX auto-detection) when `detect_cluster`
  finds a multi-process job, and otherwise does nothing. A second call is a
  no-op.

  Args:
    coordinator_address: 'host:port' of process 0's coordinator service.
    num_processes: the number of processes.
    process_id: this process, in 0..num_processes-1.
    local_device_ids: restrict this process to these local devices.
    cpu_collectives: CPU cross-process collectives, one of
      `CPU_COLLECTIVES`; None means 'gloo'.

  Raises:
    ValueError: some but not all of the three explicit arguments, or an
      invalid value (the message names the flag, value and allowed values).
  """
  global _initialized
  if _initialized or jax.distributed.is_initialized():
    logging.info('jax.distributed: already initialized, nothing to do')
    _initialized = True
    return
  if cpu_collectives is not None and cpu_collectives not in CPU_COLLECTIVES:
    raise ValueError(
      f'--cpu_collectives: invalid value {cpu_collectives!r}; allowed: '
      f'{", ".join(CPU_COLLECTIVES)}'
    )
  values = dict(
    zip(_EXPLICIT, (coordinator_address, num_processes, process_id))
  )
  given = [k for k, v in values.items() if v is not None]
  if given:
    missing = [k for k in _EXPLICIT if k not in given]
    if missing:
      raise ValueError(
        'distributed start-up: --coordinator_address, --num_processes and '
        '--process_id must be given together; given: '
        + ', '.join(f'--{k}={values[k]!r}' for k in given)
        + '; missing: '
        + ', '.join(f'--{k}' for k in missing)
      )
    _check_explicit(coordinator_address, num_processes, process_id)
    kwargs: dict[str, Any] = dict(values)
    reason = 'explicit flags'
  else:
    reason = detect_cluster()
    if reason is None:
      logging.info('jax.distributed: single process, not initialized')
      _initialized = True
      return
    kwargs = {}
  if local_device_ids is not None:
    ids = list(local_device_ids)
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
      raise ValueError(
        f'local_device_ids: invalid value {local_device_ids!r}; allowed: '
        'non-negative integers'
      )
    kwargs['local_device_ids'] = ids
  _set_cpu_collectives(cpu_collectives or 'gloo')
  logging.info('jax.distributed: initializing (%s) %s', reason, kwargs)
  jax.distributed.initialize(**kwargs)
  _initialized = True
  logging.info('jax.distributed: %s', process_info())


def process_info() -> dict[str, Any]:
  """This process's place in the job, for logs (starts the backend)."""
  return {
    'process_index': jax.process_index(),
    'process_count': jax.process_count(),
    'local_device_count': jax.local_device_count(),
    'device_count': jax.device_count(),
    'platform': jax.default_backend(),
    'distributed': jax.distributed.is_initialized(),
    'host': socket.gethostname(),
  }


# ------------------------------------------------------------------- flags


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Define `--coordinator_address`, `--num_processes`, `--process_id` and
  `--cpu_collectives` (once; a second call is a no-op)."""
  if 'coordinator_address' in flag_values:
    return
  flags.DEFINE_string(
    'coordinator_address',
    None,
    "Generic clusters: 'host:port' of process 0's coordinator. Give with "
    '--num_processes and --process_id; TPU pods need none of the three.',
    flag_values=flag_values,
  )
  flags.DEFINE_integer(
    'num_processes',
    None,
    'Generic clusters: the number of processes.',
    flag_values=flag_values,
  )
  flags.DEFINE_integer(
    'process_id',
    None,
    'Generic clusters: this process, 0..num_processes-1.',
    flag_values=flag_values,
  )
  flags.DEFINE_enum(
    'cpu_collectives',
    None,
    list(CPU_COLLECTIVES),
    'CPU cross-process collectives (default gloo).',
    flag_values=flag_values,
  )


def initialize_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """`initialize` with the values of the flags of `define_flags`."""

  def value(name: str) -> Any:
    return flag_values[name].value if name in flag_values else None

  initialize(
    coordinator_address=value('coordinator_address'),
    num_processes=value('num_processes'),
    process_id=value('process_id'),
    cpu_collectives=value('cpu_collectives'),
  )
