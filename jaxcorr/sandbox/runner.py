"""Run model-written Python in a contained process: `run_python`.

Why the kernel's namespaces and rlimits, driven from the standard library
(`contain.py`), and not a sandbox package: what a reward needs (no network,
no view of the trainer's files, CPU / memory / file-size / process limits,
a scratch directory, a wall-clock kill of everything the code started) is
what bubblewrap, nsjail and firejail do with the same kernel features, but
each is an OS package CI would have to install, and nsjail has none in
Debian. The Linux calls are few (`unshare`, `mount`, `pivot_root`,
`setrlimit`, `prctl`, `capset`) and run in a fresh `python -I -S`
launcher, never in the trainer (a multithreaded process must not fork and
mount). SandboxFusion-style HTTP services need a server to run.
Containment needs Linux with user namespaces (or root); `check_available`
says why when it is missing.

Each run: the launcher (a new session, so the whole process group can be
killed) builds the sandbox and forks the program as PID 1 of a PID
namespace; `run_python` reads its stdout and stderr up to `max_output`
bytes each and kills the group when the output passes the cap or the
wall clock passes `timeout_s`. The kernel then kills every process left
in the namespace. Start-up is about 0.1 s (two interpreter starts and the
mounts; bench/sandbox.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from jaxcorr.config.fields import integer, number, setting, validate

# Seconds the launcher may take to reap a killed sandbox before its whole
# process group is killed too.
REAP_S = 5.0
CONTAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'contain.py')

# Outcomes (`Result.status`); each is the reason a reward reports.
OK = 'ok'
ERROR = 'error'  # exited non-zero (an exception, a failed test, sys.exit)
TIMEOUT = 'timeout'  # past the wall clock (or its CPU seconds)
MEMORY = 'memory'  # MemoryError under the address-space limit
OUTPUT = 'output_limit'  # wrote more than max_output bytes
KILLED = 'killed'  # ended by another signal
SETUP = 'setup_failed'  # the sandbox could not be built (the host's fault)
STATUSES = (OK, ERROR, TIMEOUT, MEMORY, OUTPUT, KILLED, SETUP)


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one run may use (per run; rlimits are per process except
  `procs`, the processes of the run's own user namespace)."""

  timeout_s: float = setting(
    5.0, number(0, lo_open=True), 'Wall-clock seconds before the group dies.'
  )
  cpu_s: int = setting(5, integer(1), 'CPU seconds per process (RLIMIT_CPU).')
  memory_mb: int = setting(
    512, integer(64), 'Address space per process in MiB (RLIMIT_AS).'
  )
  file_mb: int = setting(
    8, integer(1), 'Largest file it may write in MiB (RLIMIT_FSIZE).'
  )
  scratch_mb: int = setting(
    16, integer(1), 'Size of /scratch (a tmpfs, the only writable place).'
  )
  procs: int = setting(
    16, integer(2), 'Processes at once, the program included (RLIMIT_NPROC).'
  )
  open_files: int = setting(64, integer(16), 'Open files (RLIMIT_NOFILE).')
  max_output: int = setting(
    65536, integer(1), 'Bytes kept of stdout and of stderr; more kills it.'
  )

  def __post_init__(self):
    validate(self)


@dataclasses.dataclass(frozen=True)
class Result:
  """How a run ended: `status` (one of `STATUSES`), the exit code or
  signal, the captured output (at most `max_output` bytes each), seconds
  of wall clock."""

  status: str
  returncode: int | None
  signal: int | None
  stdout: str
  stderr: str
  seconds: float
  detail: str = ''


def _interpreter() -> tuple[str, list[str]]:
  """The real interpreter (not a virtualenv's link) and the directories
  the sandbox must see to run it."""
  python = os.path.realpath(sys.executable)
  binds = ['/usr']
  prefix = os.path.realpath(sys.base_prefix)
  if not (prefix + '/').startswith('/usr/'):
    binds.append(prefix)
  return python, binds


def _kill_group(proc: subprocess.Popen) -> None:
  with contextlib.suppress(ProcessLookupError):
    os.killpg(proc.pid, signal.SIGKILL)


def _reports(data: bytes) -> dict:
  """The launcher's status lines merged (module doc of contain.py)."""
  report = {}
  for line in data.decode(errors='replace').splitlines():
    with contextlib.suppress(ValueError):
      report.update(json.loads(line))
  return report


def _stop(proc: subprocess.Popen, status_fd: int, status: bytearray) -> None:
  """Kills the program, PID 1 of its namespace: the kernel kills the rest
  and the launcher returns once they are gone, so nothing outlives the
  run. The group is killed when the program's PID is not known yet, or
  the launcher does not exit in time."""
  pid = _reports(bytes(status)).get('pid')
  if pid is None:
    _kill_group(proc)
  else:
    with contextlib.suppress(ProcessLookupError):
      os.kill(pid, signal.SIGKILL)
  try:
    proc.wait(timeout=REAP_S)
  except subprocess.TimeoutExpired:
    _kill_group(proc)
  os.set_blocking(status_fd, False)
  with contextlib.suppress(BlockingIOError):
    while chunk := os.read(status_fd, 65536):
      status += chunk


def _read(proc, status_fd, limits: Limits) -> tuple[dict, str | None]:
  """Reads stdout, stderr and the launcher's status until all close, the
  clock runs out, or an output passes its cap; (bytes per stream, why the
  group was killed or None)."""
  deadline = time.monotonic() + limits.timeout_s
  sel = selectors.DefaultSelector()
  streams = {'stdout': proc.stdout, 'stderr': proc.stderr}
  data = {name: bytearray() for name in (*streams, 'status')}
  for name, f in streams.items():
    sel.register(f.fileno(), selectors.EVENT_READ, name)
  sel.register(status_fd, selectors.EVENT_READ, 'status')
  why = None
  try:
    while sel.get_map():
      left = deadline - time.monotonic()
      if left <= 0:
        why = TIMEOUT
        break
      for key, _ in sel.select(left):
        chunk = os.read(key.fd, 65536)
        if not chunk:
          sel.unregister(key.fd)
          continue
        data[key.data] += chunk
        if key.data != 'status' and len(data[key.data]) > limits.max_output:
          why = OUTPUT
      if why:
        break
  finally:
    sel.close()
  if why:
    _stop(proc, status_fd, data['status'])
  return data, why


def _classify(report: dict, err: bytes, why: str | None) -> tuple[str, str]:
  """(status, detail) of a finished run."""
  if why:
    return why, ''
  if 'error' in report:
    return SETUP, report['error']
  if 'signal' in report:
    sig = report['signal']
    if sig in (signal.SIGXCPU, signal.SIGKILL) and not err.strip():
      return TIMEOUT, f'signal {sig} (CPU limit)'
    return KILLED, f'signal {sig}'
  if report.get('returncode') == 0:
    return OK, ''
  tail = err.decode('utf-8', 'replace').rstrip().rsplit('\n', 1)[-1]
  if tail.startswith('MemoryError'):
    return MEMORY, tail
  return ERROR, tail[:200]


def run_python(
  files: Mapping[str, str],
  main: str,
  limits: Limits = Limits(),
  argv: Sequence[str] = (),
) -> Result:
  """Runs `python -E -s -S main *argv` (standard library only, `main`'s
  directory on the path) in a new sandbox whose /scratch (its
  working directory) holds `files` (name -> text; flat names). Never
  raises for anything the program does; `Result.status` says how it
  ended."""
  for name in files:
    if not name or '/' in name or name.startswith('.'):
      raise ValueError(f'sandbox file name {name!r}: allowed: a flat name')
  python, binds = _interpreter()
  request = {
    'parent': os.getpid(),
    'python': python,
    'binds': binds,
    'files': dict(files),
    'argv': [main, *argv],
    'limits': dataclasses.asdict(limits),
  }
  start = time.monotonic()
  status_r, status_w = os.pipe()
  try:
    proc = subprocess.Popen(
      [python, '-I', '-S', CONTAIN, str(status_w)],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      pass_fds=(status_w,),
      start_new_session=True,
      env={},
    )
  finally:
    os.close(status_w)
  try:
    try:
      proc.stdin.write(json.dumps(request).encode())
      proc.stdin.close()
    except BrokenPipeError:
      pass
    data, why = _read(proc, status_r, limits)
    proc.wait()
  finally:
    _kill_group(proc)  # anything left of the group (the launcher reaped)
    os.close(status_r)
    for f in (proc.stdout, proc.stderr):
      f.close()
  report = _reports(bytes(data['status']))
  if not report.keys() & {'returncode', 'signal', 'error'}:
    report['error'] = f'the launcher died (exit {proc.returncode})'
  status, detail = _classify(report, bytes(data['stderr']), why)
  cap = limits.max_output
  return Result(
    status=status,
    returncode=report.get('returncode'),
    signal=report.get('signal'),
    stdout=bytes(data['stdout'][:cap]).decode('utf-8', 'replace'),
    stderr=bytes(data['stderr'][:cap]).decode('utf-8', 'replace'),
    seconds=time.monotonic() - start,
    detail=detail,
  )


@functools.cache
def check_available() -> None:
  """ValueError saying why this machine cannot build a sandbox (no Linux
  namespaces, a kernel that forbids them); cached."""
  if not sys.platform.startswith('linux'):
    raise ValueError('the code sandbox needs Linux (namespaces, rlimits)')
  result = run_python({'main.py': 'print(6 * 7)'}, 'main.py')
  if result.status != OK or result.stdout.strip() != '42':
    raise ValueError(
      'the code sandbox cannot start on this machine: '
      f'{result.detail or result.stderr.strip() or result.status} (it needs '
      'root or unprivileged user namespaces: sysctl '
      'kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0)'
    )
