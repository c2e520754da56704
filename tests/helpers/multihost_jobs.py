"""Jobs of tests/helpers/multihost_driver.py (one or more processes of a CPU
trainer job) and what they leave behind: metrics.jsonl rows and parameters.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from tests.helpers import process_group

DRIVER = pathlib.Path(__file__).resolve().with_name('multihost_driver.py')
PRESET = 'decoupled_token_is'
METRIC_RTOL = 1e-5
# Same rollouts, different reduction order (gloo across 2 processes vs one
# process): Adam's m/sqrt(v) amplifies fp32 rounding on near-zero gradients.
# Measured 1.04e-7 before the engine v2 / frontier merges and 1.03e-6 after
# (same tokens and rewards, metrics within 1e-5): 2e-6 is the bound, and the
# parameters still move more than 50x that in two steps.
PARAM_ATOL = 2e-6
VOLATILE = ('time/', 'perf/tokens_per_s')
TIMEOUT_S = 420


def run_job(processes: int, devices: int, args: list[str]) -> None:
  """Run the driver in `processes` processes; fail with their output."""
  port = str(process_group.free_port())
  argvs = [
    [
      str(DRIVER),
      f'--devices={devices}',
      f'--processes={processes}',
      f'--process_id={pid}',
      f'--port={port}',
      f'--preset={PRESET}',
      *args,
    ]
    for pid in range(processes)
  ]
  # Halves XLA's compile time, which is most of this test's; both jobs
  # compile the same way, so the comparison is unaffected.
  env = process_group.clean_env(XLA_FLAGS='--xla_backend_optimization_level=0')
  results = process_group.run_group(argvs, env=env, timeout_s=TIMEOUT_S)
  for pid, (code, out) in enumerate(results):
    assert code == 0, f'process {pid} failed:\n{out[-6000:]}'
    assert f'DONE process {pid}' in out, out[-6000:]


def read_metrics(workdir: pathlib.Path) -> list[dict]:
  """The rows of `workdir`'s metrics.jsonl without the VOLATILE keys."""
  with open(workdir / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f]
  return [
    {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows
  ]


def load_arrays(*paths: pathlib.Path) -> dict[str, np.ndarray]:
  """The arrays of the drivers' .npz files at `paths`, in one dict (their
  keys start with distinct workdir names)."""
  arrays = {}
  for path in paths:
    with np.load(path) as f:
      arrays.update({k: f[k] for k in f.files})
  return arrays


def params(arrays: dict, prefix: str) -> dict[str, np.ndarray]:
  """`{path: array}` of one params tree of the drivers' .npz files."""
  n = len(prefix) + 1
  return {k[n:]: v for k, v in arrays.items() if k.startswith(prefix + '/')}


def max_diff(a: dict, b: dict) -> float:
  """The largest |a - b| over two params trees with the same paths."""
  assert a and a.keys() == b.keys()
  return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def assert_metrics_close(got: list[dict], want: list[dict]) -> str:
  """Same steps, keys and values (within METRIC_RTOL); returns the worst
  difference, for the log."""
  assert [r['step'] for r in got] == [r['step'] for r in want]
  worst = (0.0, '')
  for g, w in zip(got, want):
    assert g.keys() == w.keys(), g.keys() ^ w.keys()
    for k, x in w.items():
      rel = abs(g[k] - x) / max(1.0, abs(x))
      assert rel <= METRIC_RTOL, (w['step'], k, g[k], x)
      worst = max(worst, (rel, f'{k} at step {w["step"]}: {g[k]} vs {x}'))
  return f'{worst[0]:.3g} ({worst[1]})'
