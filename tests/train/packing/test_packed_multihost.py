"""`train.packing` with several processes trains like one process.

Two jobs of `tests/helpers/multihost_driver.py` on
`configs/arith_tiny.py:pulse+decoupled_token_is` with `train.packing=True`
and shuffled mini-batches: 2 processes x 4 CPU devices (gloo) and 1 process
x 8 devices, RL steps 1-2. Each process gathers every row and lays out the
whole batch (jaxcorr/train/rl_step.py `RLStep.pack`), so the packed rows,
their shuffle and hence every loss must be those of one process: metrics
(the packed fill included) and parameters within the tolerances of
tests/train/test_multihost.py, which says why they are what they are.
"""

from __future__ import annotations

from tests.helpers import multihost_jobs as jobs

PACKED = ['--set=train.packing=True', '--set=train.shuffle_minibatches=True']


def test_two_processes_pack_like_one(tmp_path):
  two, one = tmp_path / 'two', tmp_path / 'one'
  jobs.run_job(2, 4, [f'--workdir={two}', f'--out={tmp_path}/two.npz', *PACKED])
  jobs.run_job(1, 8, [f'--workdir={one}', f'--out={tmp_path}/one.npz', *PACKED])
  rows_two = jobs.read_metrics(two)
  rows_one = jobs.read_metrics(one)
  assert [r['step'] for r in rows_one] == [1, 2]
  for r in rows_one:  # packed, and something to learn from
    assert 0 < r['perf/packed_fill'] <= 1, r
    assert r['actor/grad_norm'] > 0, r
  worst = jobs.assert_metrics_close(rows_two, rows_one)
  print(f'worst metric difference, packed, 2 processes vs 1: {worst}')
  for r2, r1 in zip(rows_two, rows_one):
    for k in ('perf/packed_fill', 'perf/train_tokens', 'reward/mean'):
      assert r2[k] == r1[k], k

  arrays = jobs.load_arrays(tmp_path / 'two.npz', tmp_path / 'one.npz')
  got, want = jobs.params(arrays, 'two/final'), jobs.params(arrays, 'one/final')
  diff = jobs.max_diff(got, want)
  print(f'max |param diff| after 2 packed steps, 2 processes vs 1: {diff:.3g}')
  assert diff <= jobs.PARAM_ATOL
  moved = jobs.max_diff(want, jobs.params(arrays, 'one/step0'))
  assert moved > 50 * jobs.PARAM_ATOL, moved
