"""A group of local processes forming one multi-process JAX job (tests).

`jax.distributed` on CPU needs a free coordinator port, an environment
without the parent's XLA/JAX/TPU settings (pytest's 8 fake devices, a
detected cluster) and every process started before any of them can finish.
`run_group` does that and returns each process's exit code and output.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from jaxcorr import distributed

REPO = pathlib.Path(__file__).resolve().parents[2]


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
  """This environment without XLA/JAX/TPU settings, with the repo on the
  path, plus `extra`."""
  env = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(('XLA_', 'JAX_', 'TPU_', 'MEGASCALE_'))
    and k not in (distributed.ENV_SWITCH, 'CLOUD_TPU_TASK_ID')
  }
  env['PYTHONPATH'] = os.pathsep.join(
    [str(REPO), *filter(None, [os.environ.get('PYTHONPATH')])]
  )
  env.update(extra)
  return env


def run_group(
  argvs: Sequence[Sequence[str]], *, env: dict[str, str], timeout_s: float
) -> list[tuple[int, str]]:
  """Starts `python argv` for each argv, waits for all (killing what is
  left at the deadline); `(returncode, stdout + stderr)` per process."""
  procs = [
    subprocess.Popen(
      [sys.executable, *argv],
      cwd=REPO,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for argv in argvs
  ]
  deadline = time.monotonic() + timeout_s
  outputs = []
  try:
    for p in procs:
      left = max(deadline - time.monotonic(), 1)
      outputs.append(p.communicate(timeout=left)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return [(p.returncode, out) for p, out in zip(procs, outputs)]
