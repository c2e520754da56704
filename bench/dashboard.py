"""The dashboard on a long run: server response time per page
(docs/benchmarks.md, "Dashboard").

Writes a workdir with the trainer's writers: a metrics.jsonl of
`--steps` steps (~100 metrics a line, as a real step logs), a trace step
of `--trace_rows` rows x `--trace_len` tokens (the large trace file), and
`--samples` eval samples; serves it with uvicorn on a local port, and
times each page as the browser loads it: the HTML and every JSON request
the page's script makes, over HTTP. 'cold' is the first load after the
server started (metrics.jsonl parsed whole), 'warm' the next, 'live' a
load after the writer appended 100 steps (only those are read).

    .venv/bin/python bench/dashboard.py [--steps=10000]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx
import uvicorn

from jaxcorr.dashboard import app as app_lib
from jaxcorr.train.tracker.metrics import MetricWriter
from tests.helpers import dashboard_workdir as wd


def pages(step: int) -> dict[str, list[str]]:
  """Each page's requests, in the order its script makes them."""
  keys = ','.join(k for _, ks in app_lib.OVERVIEW for k in ks)
  return {
    'overview': [
      '/',
      '/api/runs',
      f'/api/series?keys={keys}',
      f'/api/latest?keys={app_lib.HISTOGRAMS}',
    ],
    'trajectory': [
      '/trajectory',
      '/api/runs',
      '/api/traces?run=0',
      f'/api/samples?run=0&step={step}&q=',
      f'/api/trace?run=0&step={step}',
      f'/api/trace_row?run=0&step={step}&row=0',
    ],
    'search': [f'/api/samples?run=0&step={step}&q=7%2B'],
    'lab': ['/lab', '/api/lab'],
  }


def load(client: httpx.Client, urls: list[str]) -> str:
  """'wall/cpu' seconds of a page's requests; cpu: this process's (the
  server's and the client's), what a busy machine does not inflate."""
  t, c = time.perf_counter(), time.process_time()
  for u in urls:
    r = client.get(u)
    r.raise_for_status()
  return f'{time.perf_counter() - t:.3f}/{time.process_time() - c:.3f}'


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument('--steps', type=int, default=10_000)
  p.add_argument('--trace_rows', type=int, default=64)
  p.add_argument('--trace_len', type=int, default=2048)
  p.add_argument('--samples', type=int, default=2000)
  args = p.parse_args()
  root = tempfile.mkdtemp(prefix='bench_dashboard_')
  run = os.path.join(root, 'run')
  t = time.perf_counter()
  wd.write_workdir(
    run,
    args.steps,
    trace_rows=args.trace_rows,
    trace_len=args.trace_len,
    samples=args.samples,
  )
  sizes = {
    n: os.path.getsize(os.path.join(run, f))
    for n, f in (
      ('metrics.jsonl', 'metrics.jsonl'),
      ('trace', f'traces/step_{args.steps}.jsonl'),
      ('eval samples', f'eval_samples/step_{args.steps}.jsonl'),
    )
  }
  print(f'wrote the workdir in {time.perf_counter() - t:.1f} s:')
  for n, b in sizes.items():
    print(f'  {n}: {b / 2**20:.1f} MiB')
  lab = os.path.join(os.path.dirname(__file__), '..', 'docs', 'mismatch_lab')
  app = app_lib.Dashboard([run], lab).app()
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  server = uvicorn.Server(
    uvicorn.Config(app, host='127.0.0.1', port=port, log_level='warning')
  )
  threading.Thread(target=server.run, daemon=True).start()
  while not server.started:
    time.sleep(0.01)
  load_avg = os.getloadavg()[0]
  print(
    f'{platform.node()}: {os.cpu_count()} CPUs, load average {load_avg:.1f}'
  )
  print('seconds per page, wall/cpu:')
  print(f'{"page":<12}{"cold":>14}{"warm":>14}{"live":>14}')
  try:
    with httpx.Client(base_url=f'http://127.0.0.1:{port}') as client:
      for name, urls in pages(args.steps).items():
        cold, warm = load(client, urls), load(client, urls)
        with MetricWriter(run) as writer:
          last = args.steps + (100 if name == 'overview' else 0)
          for s in range(last - 99, last + 1) if name == 'overview' else ():
            writer.write(s, wd.step_metrics(s))
        live = load(client, urls)
        print(f'{name:<12}{cold:>14}{warm:>14}{live:>14}')
  finally:
    server.should_exit = True
    shutil.rmtree(root)


if __name__ == '__main__':
  main()
