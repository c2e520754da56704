"""Resuming `rollout.mode='stream'` (weight_sync='scheduled'): what is exact
and what is not, as jaxcorr/train/stream_rollout.py ("Resume") documents.

Runs of `tests/multihost_driver.py` (1 process, 8 CPU devices; the pulse
config with its scattering reward, so every update moves the weights) in
the streaming mode (max_staleness=2, queue_size=2, decode_chunk=2: rows in
flight across weight swaps), checkpoint_every=2, each recording the rows it
trains on:

* `full`: 4 steps uninterrupted;
* `part`: num_steps=2 (nothing sampled past draw 1), then resumed to 4;
* `cut`: num_steps=4, SIGTERM after step 2: the trainer checkpoints at
  step 2 and stops with draws 2 and 3 in flight; then resumed to 4.

The contract, asserted:

* steps 1-2 are the full run's bit for bit (rows, metrics, the step-2
  checkpoint): batches 0 and 1 are sampled by version 0 alone (the
  schedule takes version 1 only once both are done), whatever else was in
  flight;
* after the resume each step's batch holds the full run's prompts in the
  same rows (the checkpoint's loader state; the same sampling keys);
* what differs is the rows that were in flight at the checkpoint: the
  resumed producer starts empty with the checkpoint's weights (version 2)
  and samples draws 2 and 3 from their first token under them, where the
  full run had sampled draw 2 by versions 0 and 1 before the checkpoint.
  Every row agrees with the full run up to its first token sampled by
  another version (versions 0-2 are the same weights in both runs, 3 is
  not: it trained on other rows), and can differ only from there;
* in-flight rows leave no trace: the preempted run resumes exactly like
  the one that stopped with nothing in flight (rows, metrics, parameters).

Measured (CPU): the full run's step 3 has 4 rows sampled by version 0 then
1 and 12 by version 0 or 1 alone; the resumed steps 3-4 are version 2
throughout (staleness 0 and 1, where the full run has 2 and 2). The
compilation cache is shared by both jobs (the second compiles nothing).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import test_multihost_train as mh

CHECKPOINT = 2
STREAM = (
  'rollout.mode=stream',
  'rollout.weight_sync=scheduled',
  'rollout.max_staleness=2',
  'rollout.queue_size=2',
  'rollout.decode_chunk=2',  # rows span several chunks, hence swaps
)
VOLATILE = ('time/', 'perf/', 'stream/')


def _run_jobs(root: pathlib.Path) -> None:
  """`full`, `part`, `cut` (job a), then `part` and `cut` resumed (job b);
  rows to `root/rows_<job>`, parameters to `root/<job>.npz`."""
  sets = [f'--set={s}' for s in STREAM]
  cache = f'--compile_cache={root / "compile_cache"}'
  for job, names, extra in (
    (
      'a',
      ('full', 'part', 'cut'),
      [
        f'--set=part:train.num_steps={CHECKPOINT}',
        f'--preempt=cut:{CHECKPOINT}',
      ],
    ),
    ('b', ('part', 'cut'), []),
  ):
    mh._job(
      1,
      8,
      [
        *(f'--workdir={root / name}' for name in names),
        f'--out={root / job}.npz',
        f'--rollouts={root / f"rows_{job}"}',
        '--num_steps=4',
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


def _metrics(workdir: pathlib.Path) -> list[dict]:
  with open(workdir / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f]
  return [
    {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows
  ]


def _assert_same(a: dict, b: dict, what) -> None:
  assert a and a.keys() == b.keys(), (what, a.keys() ^ b.keys())
  for k in b:
    np.testing.assert_array_equal(a[k], b[k], err_msg=f'{what}: {k}')


def _common_prefix(a: dict, b: dict) -> np.ndarray:
  """[B] per row: how many leading tokens both runs sampled, each by the
  same policy version in both, at most `CHECKPOINT` (the versions whose
  weights the runs share)."""
  same = (
    (a['response_mask'] == b['response_mask'])
    & a['response_mask']
    & (a['policy_version'] == b['policy_version'])
    & (b['policy_version'] <= CHECKPOINT)
  )
  return np.where(same.all(1), same.shape[1], np.argmin(same, axis=1))


def test_stream_resume_keeps_prompts_and_resamples_in_flight_rows(tmp_path):
  _run_jobs(tmp_path)
  before, after = (_load(tmp_path / f'rows_{j}' / 'p0.npz') for j in 'ab')
  params = {**_load(tmp_path / 'a.npz'), **_load(tmp_path / 'b.npz')}
  full_metrics = _metrics(tmp_path / 'full')
  assert [r['step'] for r in full_metrics] == [1, 2, 3, 4]

  # Before the checkpoint: the full run's, bit for bit.
  for step in (1, 2):
    full = _rows(before, 'full', step)
    assert (full['policy_version'][full['response_mask']] == 0).all()
    for run in ('part', 'cut'):
      _assert_same(_rows(before, run, step), full, (run, step))
  step2 = mh._params(params, 'full/step2')
  for run in ('part', 'cut'):
    _assert_same(mh._params(params, f'{run}/step2'), step2, run)
    assert _metrics(tmp_path / run)[:2] == full_metrics[:2]
  # The versions are different weights: each step moves them.
  assert mh._max_diff(step2, mh._params(params, 'full/step0')) > 1e-5

  # After it: the same prompts in the same rows, the same tokens up to the
  # first one another version sampled.
  moved = 0
  for step in (3, 4):
    a, b = _rows(after, 'part', step), _rows(before, 'full', step)
    for field in ('prompt_tokens', 'group_id', 'sample_id'):
      np.testing.assert_array_equal(a[field], b[field], err_msg=field)
    # The resumed producer starts from the checkpoint's weights.
    assert (a['policy_version'][a['response_mask']] >= CHECKPOINT).all()
    n = _common_prefix(a, b)
    for row, k in enumerate(n):
      for field in ('response_tokens', 'rollout_logp'):
        np.testing.assert_array_equal(a[field][row, :k], b[field][row, :k])
    moved += int((n < b['response_mask'].sum(1)).sum())
    same = (a['response_tokens'] == b['response_tokens']).all(1)
    print(
      f'step {step}: {int(same.sum())} of {len(same)} resumed rows have '
      f"the full run's tokens, {int((n > 0).sum())} share a first token "
      'sampled by the same version'
    )
  # Draw 2 was in flight at the checkpoint: the full run sampled it by
  # versions 0 and 1, which the resumed run no longer holds.
  full3 = _rows(before, 'full', 3)
  assert full3['policy_version'][full3['response_mask']].max() < CHECKPOINT
  assert moved > 0
  diff = mh._max_diff(
    mh._params(params, 'part/final'), mh._params(params, 'full/final')
  )
  print(f'max |param diff| after 4 steps, resumed vs full: {diff:.3g}')
  assert diff > 0

  # In-flight rows at the preemption left nothing behind.
  for step in (3, 4):
    _assert_same(_rows(after, 'cut', step), _rows(after, 'part', step), step)
  _assert_same(
    mh._params(params, 'cut/final'), mh._params(params, 'part/final'), 'final'
  )
  assert _metrics(tmp_path / 'cut') == _metrics(tmp_path / 'part')
