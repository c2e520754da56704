"""Resuming the asynchronous modes is exact: `rollout.mode='stream'` with
weight_sync='scheduled' from a periodic checkpoint
(jaxcorr/train/rollouts/stream.py, "Resume"), and fixed-lag
`rollout.mode='async'` from any checkpoint
(jaxcorr/train/rollouts/fixed_lag.py; the last test).

Runs of `tests/helpers/multihost_driver.py` (1 process, 8 CPU devices; the pulse
config with its scattering reward, so every update moves the weights) in
the streaming mode (max_staleness=2, queue_size=2, decode_chunk=2: rows in
flight across weight swaps), checkpoint_every=3, each recording the rows it
trains on:

* `full`: 6 steps uninterrupted;
* `cut`: num_steps=6, SIGTERM after step 3 (a checkpoint step): the
  trainer checkpoints and stops with later draws in flight; then resumed.
  (A run stopped by `num_steps=3` resumes from the same drained
  checkpoint with nothing in flight, the easier case; it was a third run
  here until the default test run had to get shorter, and the sync mode's
  `test_resume_is_exact` in tests/train/test_loop.py still covers it.)

The stream drains at every checkpoint step, so an uninterrupted run
starts each checkpoint interval exactly as a resumed one does: every step
of `cut` equals the full run's bit for bit (rows, per-token
versions and log-probs, metrics, final parameters), while inside each
interval rows are still sampled across in-flight swaps (asserted, so the
equality is not that of a run without swaps).
"""

from __future__ import annotations

import json
import pathlib
import signal

import numpy as np

from tests.helpers import multihost_jobs as jobs
from tests.helpers import process_group
from tests.helpers.stream_metrics import assert_bounded_and_mixed

CHECKPOINT = 3
STEPS = 6
STREAM = (
  'rollout.mode=stream',
  'rollout.weight_sync=scheduled',
  'rollout.max_staleness=2',
  'rollout.queue_size=2',
  'rollout.decode_chunk=2',  # rows span several chunks, hence swaps
  f'train.checkpoint_every={CHECKPOINT}',
)
VOLATILE = ('time/', 'perf/', 'stream/')


def _run_jobs(root: pathlib.Path) -> None:
  """`full` and `cut` (job a), then `cut` resumed (job b);
  rows to `root/rows_<job>`, parameters to `root/<job>.npz`."""
  sets = [f'--set={s}' for s in STREAM]
  cache = f'--compile_cache={root / "compile_cache"}'
  for job, names, extra in (
    (
      'a',
      ('full', 'cut'),
      [f'--preempt=cut:{CHECKPOINT}'],
    ),
    ('b', ('cut',), []),
  ):
    jobs.run_job(
      1,
      8,
      [
        *(f'--workdir={root / name}' for name in names),
        f'--out={root / job}.npz',
        f'--rollouts={root / f"rows_{job}"}',
        f'--num_steps={STEPS}',
        cache,
        *sets,
        *extra,
      ],
    )


def _load(path: pathlib.Path) -> dict:
  with np.load(path) as f:
    return {k: f[k] for k in f.files}


def _rows(arrays: dict, run: str, step: int) -> dict:
  prefix = f'{run}/step{step}/'
  return {
    k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)
  }


def _metrics(workdir: pathlib.Path, volatile: bool = False) -> list[dict]:
  with open(workdir / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f]
  if volatile:
    return rows
  return [
    {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows
  ]


def _assert_same(a: dict, b: dict, what) -> None:
  assert a and a.keys() == b.keys(), (what, a.keys() ^ b.keys())
  for k in b:
    np.testing.assert_array_equal(a[k], b[k], err_msg=f'{what}: {k}')


def test_stream_resume_from_a_checkpoint_is_exact(tmp_path):
  _run_jobs(tmp_path)
  before, after = (_load(tmp_path / f'rows_{j}' / 'p0.npz') for j in 'ab')
  params = {**_load(tmp_path / 'a.npz'), **_load(tmp_path / 'b.npz')}
  full_metrics = _metrics(tmp_path / 'full')
  assert [r['step'] for r in full_metrics] == list(range(1, STEPS + 1))
  assert_bounded_and_mixed(_metrics(tmp_path / 'full', volatile=True))
  mixed = 0
  for step in range(1, STEPS + 1):
    full = _rows(before, 'full', step)
    for run in ('cut',):
      rows = before if step <= CHECKPOINT else after
      _assert_same(_rows(rows, run, step), full, (run, step))
    v = np.where(full['response_mask'], full['policy_version'], -1)
    live = np.where(full['response_mask'], v, np.iinfo(np.int32).max)
    mixed += int((v.max(1) != live.min(1)).sum())
  assert mixed > 0  # in-flight swaps happened inside the intervals
  final = jobs.params(params, 'full/final')
  for run in ('cut',):
    _assert_same(jobs.params(params, f'{run}/final'), final, run)
    assert _metrics(tmp_path / run) == full_metrics
  # The versions are different weights: each step moves them.
  assert jobs.max_diff(final, jobs.params(params, 'full/step0')) > 1e-5


# --------------------------------------------------------- fixed-lag async

LAG = 2
ASYNC = (
  'rollout.mode=async',
  f'rollout.max_staleness={LAG}',
  'rollout.queue_size=2',
  'train.checkpoint_every=2',
)


def _driver(root: pathlib.Path, names, extra) -> tuple[int, str]:
  """One process x 8 devices of tests/multihost_driver.py training the
  workdirs `names` of `root` in turn; (exit code, output)."""
  argv = [
    str(jobs.DRIVER),
    '--devices=8',
    f'--preset={jobs.PRESET}',
    *(f'--workdir={root / name}' for name in names),
    f'--out={root / names[0]}.npz',
    f'--num_steps={STEPS}',
    f'--compile_cache={root / "compile_cache"}',
    *(f'--set={s}' for s in ASYNC),
    *extra,
  ]
  env = process_group.clean_env(XLA_FLAGS='--xla_backend_optimization_level=0')
  [(code, out)] = process_group.run_group(
    [argv], env=env, timeout_s=jobs.TIMEOUT_S
  )
  return code, out


def test_fixed_lag_resume_after_sigterm_or_sigkill_is_exact(tmp_path):
  """`rollout.mode='async'`, max_staleness 2, checkpoint every 2 steps, the
  scattering reward (every update moves the weights):

  * `full`: 6 steps uninterrupted;
  * `cut`: SIGTERM after step 3, a preemption checkpoint between periodic
    ones with batches 4 and 5 (versions 1, 2) in the pipeline;
  * `kill`: SIGKILL once step 5's metrics line is written: resumed from
    checkpoint 4, step 5 is trained (and logged) again.

  Each checkpoint holds the older weights its next batches are sampled by,
  so both resumed runs write the full run's metrics.jsonl and end with its
  parameters, bit for bit. Before, the first batches after a resume were
  sampled by the resumed weights (`rollout/policy_version` 3 for 1)."""
  code, out = _driver(
    tmp_path, ('full', 'cut', 'kill'), ['--preempt=cut:3', '--kill=kill:5']
  )
  assert code == -signal.SIGKILL, out[-6000:]
  assert [r['step'] for r in _metrics(tmp_path / 'kill')] == [1, 2, 3, 4, 5]
  code, out = _driver(tmp_path, ('full', 'cut', 'kill'), [])
  assert code == 0 and 'DONE process 0' in out, out[-6000:]
  params = _load(tmp_path / 'full.npz')
  full = _metrics(tmp_path / 'full')
  assert [r['step'] for r in full] == list(range(1, STEPS + 1))
  # Version max(s - 2, 0) samples batch s (s from 0); updates are not zero.
  assert [r['rollout/policy_version'] for r in full] == [0, 0, 0, 1, 2, 3]
  assert [r['rollout/staleness_max'] for r in full] == [0, 1, 2, 2, 2, 2]
  assert min(r['actor/grad_norm'] for r in full) > 0
  final = jobs.params(params, 'full/final')
  assert jobs.max_diff(final, jobs.params(params, 'full/step2')) > 1e-5
  for run in ('cut', 'kill'):
    assert _metrics(tmp_path / run) == full, run
    _assert_same(jobs.params(params, f'{run}/final'), final, run)
