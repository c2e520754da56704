"""The code sandbox's throughput: executions per second of simple
programs, and its overhead over a bare subprocess of the same interpreter.

  python bench/sandbox.py                 # ~1 minute on a 2-core CPU
  python bench/sandbox.py --runs=200 --workers=2

1. **Bare subprocess**: `python -E -s -S -c PROGRAM` with its output
   captured, `--workers` at a time (threads, as the reward scorer runs
   calls): no namespaces, no limits, no new root.
2. **Sandbox**: `jaxcorr.sandbox.run_python` of the same program (the
   launcher, namespaces, the new root, rlimits, then the program).
3. **code_tests**: one reward call (a reply with a function, five tests,
   the harness and its nonce).

Reported: executions/s at `--workers` concurrency, and the median
latency of one run alone; the overhead is the difference of latencies.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from jaxcorr.rewards import code_tests
from jaxcorr.sandbox import run_python

PROGRAM = 'print(sum(i * i for i in range(1000)))'
REPLY = '```python\ndef f(x):\n  return x * 3\n```'
TESTS = json.dumps({'tests': [f'f({x}) == {3 * x}' for x in range(5)]})


def _bare() -> None:
  python = os.path.realpath(sys.executable)
  subprocess.run(
    [python, '-E', '-s', '-S', '-c', PROGRAM], capture_output=True, check=True
  )


def _sandbox() -> None:
  result = run_python({'main.py': PROGRAM}, 'main.py')
  assert result.status == 'ok', result


def _reward() -> None:
  assert code_tests(REPLY, TESTS).reason == 'passed'


def _measure(fn, runs: int, workers: int) -> tuple[float, float]:
  """(executions/s with `workers` at once, median seconds of one alone)."""
  alone = []
  for _ in range(max(runs // 10, 5)):
    start = time.perf_counter()
    fn()
    alone.append(time.perf_counter() - start)
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    list(pool.map(lambda _: fn(), range(runs)))
  return runs / (time.perf_counter() - start), statistics.median(alone)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--runs', type=int, default=100)
  parser.add_argument('--workers', type=int, default=2)
  args = parser.parse_args()
  print(f'{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs')
  rows = {}
  for name, fn in (('bare', _bare), ('sandbox', _sandbox), ('code', _reward)):
    fn()  # warm the page cache
    rows[name] = _measure(fn, args.runs, args.workers)
  print(f'{"":12}{"exec/s":>10}{"one run (ms)":>15}')
  for name, (rate, one) in rows.items():
    print(f'{name:12}{rate:10.1f}{one * 1e3:15.1f}')
  extra = (rows['sandbox'][1] - rows['bare'][1]) * 1e3
  print(f'sandbox overhead per run: {extra:.1f} ms')


if __name__ == '__main__':
  main()
