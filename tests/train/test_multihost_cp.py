"""Context parallelism in two processes (4 CPU devices each, gloo
collectives): `mesh.sequence` splits rows within each host while `fsdp`
spans the hosts, and the run trains like one process of 8 devices without
it; in one process, with the rollout engine on the same devices (its mesh
folds `sequence` into `fsdp`), likewise.

Jobs of `tests/helpers/multihost_driver.py` on the pulse config with rows
of 8 + 8 tokens (`rollout.max_new_tokens=8`, so 4 devices split a row):

* `two`: 2 processes x 4 devices, fsdp=2 x sequence=4, one RL step;
* `one` and `onecp`: 1 process x 8 devices, fsdp=8, then fsdp=2 x
  sequence=4, one RL step each.

Measured (CPU, JAX 0.10.2): parameters within 3.7e-7 (two) and 5.7e-7
(onecp) of `one`, every metric within 1e-5 x max(1, |value|): the
tolerances of tests/train/test_multihost.py (`jobs.PARAM_ATOL`,
`jobs.METRIC_RTOL`). A mesh whose batch axes do not span the processes
(sequence=8: every device of both hosts on one row) is refused before
anything compiles: each host feeds its own rows.
"""

from __future__ import annotations

import pytest

from tests.helpers import multihost_jobs as jobs
from tests.helpers import process_group

ROWS = '--set=rollout.max_new_tokens=8'


def _close(metrics: dict, ref: dict) -> list[str]:
  """Keys of `ref`'s numeric metrics that `metrics` does not match."""
  return [
    k
    for k, v in ref.items()
    if isinstance(v, float)
    and abs(v - metrics[k]) > jobs.METRIC_RTOL * max(1.0, abs(v))
  ]


@pytest.mark.slow  # ~2.5 min of two trainer jobs; CI: test_sharding_cp.py
def test_context_parallel_trains_like_one_process(tmp_path):
  jobs.run_job(
    2,
    4,
    [f'--workdir={tmp_path}/two', f'--out={tmp_path}/two.npz',
     '--num_steps=1', ROWS, '--set=mesh.sequence=4', '--set=mesh.fsdp=2'],
  )  # fmt: skip
  jobs.run_job(
    1,
    8,
    [f'--workdir={tmp_path}/one', f'--workdir={tmp_path}/onecp',
     f'--out={tmp_path}/one.npz', '--num_steps=1', ROWS,
     '--set=onecp:mesh.sequence=4', '--set=onecp:mesh.fsdp=2'],
  )  # fmt: skip
  arrays = jobs.load_arrays(tmp_path / 'two.npz', tmp_path / 'one.npz')
  ref = jobs.params(arrays, 'one')
  ref_metrics = jobs.read_metrics(tmp_path / 'one')[0]
  assert ref_metrics['actor/loss_token_count'] > 0
  for run in ('two', 'onecp'):
    assert jobs.max_diff(jobs.params(arrays, run), ref) < jobs.PARAM_ATOL
    metrics = jobs.read_metrics(tmp_path / run)[0]
    assert _close(metrics, ref_metrics) == [], run


@pytest.mark.slow  # two processes starting (~20 s)
def test_batch_axes_must_span_the_processes(tmp_path):
  port = process_group.free_port()
  argvs = [
    [str(jobs.DRIVER), '--devices=4', '--processes=2', f'--process_id={pid}',
     f'--port={port}', f'--preset={jobs.PRESET}', f'--workdir={tmp_path}/w',
     f'--out={tmp_path}/w.npz', '--num_steps=1', ROWS,
     '--set=mesh.sequence=8']
    for pid in range(2)
  ]  # fmt: skip
  results = process_group.run_group(
    argvs, env=process_group.clean_env(), timeout_s=jobs.TIMEOUT_S
  )
  for code, out in results:
    assert code != 0
    assert 'config.mesh: data x fsdp = 1 must be a multiple of the 2' in out
