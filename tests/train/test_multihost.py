"""The trainer in two processes (4 CPU devices each, gloo collectives) trains
like one process with 8 devices, and its checkpoints restore in one process.

Three jobs of `tests/helpers/multihost_driver.py` on
`configs/arith_tiny.py:pulse+decoupled_token_is` (no SFT, no evaluation):

* `two`: 2 processes x 4 devices, RL steps 1-2 (checkpoints 0 and 2);
* `one`: 1 process x 8 devices, steps 1-3 from scratch;
* `resumed`: a copy of `two`'s workdir, resumed by 1 process x 8 devices
  (in the same job as `one`, after it) and trained for step 3.

The 2-process job must log (process 0 only) the metrics of the 1-process
one and end with its parameters, and the 1-process resume of the 2-process
checkpoint must first restore exactly the 2-process parameters and then
train step 3 like `one`.

Tolerances. Both jobs sample the same tokens for the same prompts and train
on the same global batch; what differs is float32 rounding: each host's
rollout engine runs on its 4 local devices (other partial sums in the
sharded matmuls than on 8), and gloo's cross-process all-reduces add in
another order than the in-process ones. Measured on CPU (JAX 0.10.2):
metrics within 2.4e-7 x max(1, |value|) (`rollout_corr/` IS ratios near
1, a few ulp; losses within 4e-8), parameters within 1.0e-7; rewards,
lengths and token counts equal. Tolerances: metrics 1e-5 x max(1, |value|),
parameters 1e-6 absolute: 10-40x above rounding, while one RL step moves
parameters by up to ~lr = 3e-4 (AdamW) and its metrics by ~1e-2, so a
different sample, prompt or batch order fails (keying samples by the local
prompt index moves the parameters by 1.2e-3 in 2 steps). Checkpoints
restore bit for bit. `--xla_backend_optimization_level=0` halves the
compile time, most of this test's; both jobs compile alike.

`test_host_metrics_combine_like_one_process` checks, without subprocesses,
the reduction behind the host metrics of several processes.
"""

from __future__ import annotations

import pathlib
import shutil

import jax
import numpy as np

from jaxcorr.rollout.types import RolloutBatch
from jaxcorr.train import batch as batch_lib
from jaxcorr.train.tracker import reduction
from jaxcorr.train.tracker.reduction import Metric
from tests.helpers import multihost_jobs as jobs


def _run_jobs(root: pathlib.Path) -> dict[str, np.ndarray]:
  """The three jobs of the module docstring; their .npz arrays."""
  two, one, resumed = root / 'two', root / 'one', root / 'resumed'
  jobs.run_job(
    2, 4, [f'--workdir={two}', f'--out={root}/two.npz', '--num_steps=2']
  )
  shutil.copytree(two, resumed)
  jobs.run_job(
    1,
    8,
    [
      f'--workdir={one}',
      f'--workdir={resumed}',
      f'--out={root}/one.npz',
      '--num_steps=3',
      f'--compile_cache={root}/compile_cache',
    ],
  )
  return jobs.load_arrays(root / 'two.npz', root / 'one.npz')


def test_two_processes_train_like_one_and_checkpoint_for_one(tmp_path):
  """One test, not three sharing a fixture: under pytest-xdist a module
  fixture would run the jobs again in every worker."""
  arrays = _run_jobs(tmp_path)
  one = jobs.read_metrics(tmp_path / 'one')
  two = jobs.read_metrics(tmp_path / 'two')
  resumed = jobs.read_metrics(tmp_path / 'resumed')

  # Metrics: process 0 alone writes, one line per step, those of 1 process.
  assert [r['step'] for r in one] == [1, 2, 3]
  assert [r['step'] for r in two] == [1, 2]
  worst = jobs.assert_metrics_close(two, one[:2])
  print(f'worst metric difference, 2 processes vs 1: {worst}')
  for r2, r1 in zip(two, one):
    # The rollouts are those of one process: the same tokens, rewards.
    for k in ('perf/train_tokens', 'response_length/mean', 'reward/mean'):
      assert r2[k] == r1[k], k
  for r in one:  # every step had something to learn from
    assert r['reward/std'] > 0 and r['actor/grad_norm'] > 0, r

  # Parameters after step 2.
  two_params = jobs.params(arrays, 'two/final')
  one_step2 = jobs.params(arrays, 'one/step2')
  diff = jobs.max_diff(two_params, one_step2)
  print(f'max |param diff| after 2 steps, 2 processes vs 1: {diff:.3g}')
  assert diff <= jobs.PARAM_ATOL
  # The tolerance is far below what training changes.
  moved = jobs.max_diff(one_step2, jobs.params(arrays, 'one/step0'))
  assert moved > 50 * jobs.PARAM_ATOL, moved

  # Written by 2 processes x 4 devices, read by 1 process x 8: bit for bit.
  assert jobs.max_diff(jobs.params(arrays, 'two/step2'), two_params) == 0
  assert jobs.max_diff(jobs.params(arrays, 'resumed/step2'), two_params) == 0
  # Resumed at step 2 and trained step 3 in one process: as `one` did.
  diff = jobs.max_diff(
    jobs.params(arrays, 'resumed/final'), jobs.params(arrays, 'one/final')
  )
  print(f'max |param diff| after the 1-process resume: {diff:.3g}')
  assert diff <= jobs.PARAM_ATOL
  assert [r['step'] for r in resumed] == [1, 2, 3]
  assert resumed[:2] == two  # kept on resume
  worst = jobs.assert_metrics_close(resumed[2:], one[2:])
  print(f'worst metric difference after the resume: {worst}')


def _rollouts(b: int, t: int, seed: int) -> RolloutBatch:
  rng = np.random.default_rng(seed)
  mask = np.arange(t)[None] < rng.integers(1, t + 1, b)[:, None]
  version = np.where(mask, rng.integers(3, 6, (b, t)), -1).astype(np.int32)
  return RolloutBatch(
    prompt_tokens=np.ones((b, 2), np.int32),
    prompt_mask=np.ones((b, 2), bool),
    response_tokens=mask.astype(np.int32),
    context_mask=mask.copy(),
    response_mask=mask,
    rollout_logp=np.where(mask, -0.5, 0).astype(np.float32),
    rollout_logp_truncated=None,
    temperature=np.ones(b, np.float32),
    top_k=np.zeros(b, np.int32),
    top_p=np.ones(b, np.float32),
    min_p=np.zeros(b, np.float32),
    policy_version=version,
    finish_reason=rng.integers(0, 4, b).astype(np.int8),
    group_id=np.arange(b, dtype=np.int32) // 4,
    sample_id=np.arange(b, dtype=np.int32) % 4,
  )


def test_host_metrics_combine_like_one_process():
  """Metrics of 4 equal shares, combined, are those of the whole batch."""
  b, shares = 32, 4
  batch = _rollouts(b, 7, seed=0)
  reward = np.random.default_rng(1).normal(size=b).astype(np.float32)
  failures = np.random.default_rng(2).integers(0, 2, b)

  def host(lo: int, hi: int) -> dict[str, float]:
    part = jax.tree.map(lambda x: x[lo:hi], batch)
    m = batch_lib.rollout_metrics(
      part, reward[lo:hi], trainer_version=6, max_staleness=2
    )
    m['reward/failures'] = Metric.sum(float(failures[lo:hi].sum()))
    tokens = float(np.asarray(part.context_mask).sum())
    m['perf/train_tokens'] = Metric.sum(tokens)
    return m

  whole = reduction.values(host(0, b))
  k = b // shares
  per = [host(i * k, (i + 1) * k) for i in range(shares)]
  combined = reduction.combine_processes(per)
  assert combined.keys() == whole.keys()
  for key in whole:
    np.testing.assert_allclose(
      combined[key], whole[key], rtol=1e-12, err_msg=key
    )
  assert combined['reward/max'] == max(m['reward/max'].value for m in per)
