"""Start-up: launch of `python -m jaxcorr.main` to the end of RL step 1.

  python bench/startup.py --config=configs/smollm2_arith.py
  python bench/startup.py --config=configs/smollm2_arith.py \\
      --arg=--config.train.eval_at_start=False

Runs the trainer twice in fresh workdirs that share one compilation cache
(`train.compile_cache`, a new temporary directory): the first run compiles
everything (cold), the second loads it (warm), as a restarted run does.
Each run is timed from the process start to the moment metrics.jsonl holds
step 1's row, then killed (nothing of it is needed); the load average
before and after each run is printed with it, since the machine may be
shared. `--root=DIR` keeps the workdirs and the cache there (default: a
temporary directory, removed after).
`--cache=off` times both runs without a cache (the before figures).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _step_row(path: str, step: int) -> bool:
  if not os.path.exists(path):
    return False
  with open(path) as f:
    for line in f:
      try:
        if json.loads(line).get('step') == step:
          return True
      except json.JSONDecodeError:
        pass  # a line being written
  return False


def time_to_step(args: list[str], workdir: str, step: int = 1) -> float:
  """Seconds from launch until metrics.jsonl has `step`'s row."""
  cmd = [sys.executable, '-m', 'jaxcorr.main', f'--workdir={workdir}', *args]
  t0 = time.perf_counter()
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
  metrics = os.path.join(workdir, 'metrics.jsonl')
  try:
    while not _step_row(metrics, step):
      if proc.poll() is not None:
        raise RuntimeError(f'{" ".join(cmd)} exited {proc.returncode}')
      time.sleep(0.2)
    return time.perf_counter() - t0
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--config', default='configs/smollm2_arith.py')
  p.add_argument('--arg', action='append', default=[], help='extra flag')
  p.add_argument('--cache', choices=('shared', 'off'), default='shared')
  p.add_argument('--root', default='', help='keep workdirs and cache here')
  a = p.parse_args()
  with tempfile.TemporaryDirectory() as scratch:
    tmp = a.root or scratch
    cache = os.path.join(tmp, 'cache') if a.cache == 'shared' else ''
    args = [
      f'--config={a.config}',
      f'--config.train.compile_cache={cache}',
      *a.arg,
    ]
    for name in ('cold', 'warm'):
      load0 = os.getloadavg()[0]
      s = time_to_step(args, os.path.join(tmp, name))
      load1 = os.getloadavg()[0]
      print(
        f'{name}: launch -> end of step 1 {s:.1f} s '
        f'(load average {load0:.1f} -> {load1:.1f}, {os.cpu_count()} cores)',
        flush=True,
      )


if __name__ == '__main__':
  main()
