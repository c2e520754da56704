"""Mismatch lab, MoE axis (issue 24 item 8): router replay x correction.

Runs `configs/arith_moe.py` (bf16 engine, fp32 trainer, 8 experts, top-2)
through the ordinary CLI for every cell of

  moe.router_replay in ('none', 'old', 'rollout')
  x correction in ('disabled' = correction off: the preset that changes
                   nothing in the update but still measures
                   rollout_corr/kl; correction.enabled=False would not
                   log it, 'decoupled_token_is' = the lab's default
                   correcting preset)
  x seeds (train.seed and model.init_seed),

seed-major (every cell of seed 0 first), so a grid cut short by time still
has whole seeds. Then it aggregates each run's metrics.jsonl into one table
(mean and a 95% Student-t CI over seeds):

  kl        mean over RL steps of `rollout_corr/kl`
  |kl|      mean over RL steps of |rollout_corr/kl|
  agree     mean of `moe/router_agreement` (trainer's own top-k set ==
            the engine's, per (token, MoE layer))
  differ    mean of `moe/tokens_differing`
  reward    final reward: mean `reward/mean` over the last 5 steps
  collapse  runs with a non-finite metric, or whose last-5 reward fell
            below half of their first-5 reward (and below 0.05)

The runs are shortened for a loaded 2-core CPU (`--sft-steps`,
`--steps`, no periodic eval); docs/moe.md has the measured table.

  python bench/moe_lab.py --out /tmp/moe_lab --seeds 0,1,2 --jobs 2
  python bench/moe_lab.py --out /tmp/moe_lab --aggregate-only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from scipy import stats

REPLAYS = ('none', 'old', 'rollout')
CORRECTIONS = ('disabled', 'decoupled_token_is')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_name(replay: str, corr: str, seed: int) -> str:
  return f'{replay}__{corr}__s{seed}'


def command(args, replay: str, corr: str, seed: int) -> list[str]:
  cmd = [
    sys.executable,
    '-m',
    'jaxcorr.main',
    f'--config=configs/arith_moe.py:{corr}',
    f'--workdir={os.path.join(args.out, run_name(replay, corr, seed))}',
    f'--config.moe.router_replay={replay}',
    f'--config.train.seed={seed}',
    f'--config.model.init_seed={seed}',
    f'--config.train.sft_steps={args.sft_steps}',
    f'--config.train.num_steps={args.steps}',
    '--config.train.eval_every=0',
    '--config.train.checkpoint_every=0',
    '--config.train.loggers=jsonl',
    '--config.train.log_every=10',
  ]
  return cmd


def run_one(args, cell) -> None:
  replay, corr, seed = cell
  workdir = os.path.join(args.out, run_name(replay, corr, seed))
  if os.path.exists(os.path.join(workdir, 'done')):
    return
  os.makedirs(workdir, exist_ok=True)
  # Runs of one cell differ only in seeds: a shared persistent compilation
  # cache spares each later run most of its compiles.
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.setdefault(
    'JAX_COMPILATION_CACHE_DIR', os.path.join(args.out, 'jax_cache')
  )
  t0 = time.time()
  with open(os.path.join(workdir, 'log.txt'), 'w') as log:
    rc = subprocess.call(
      command(args, replay, corr, seed),
      cwd=ROOT,
      stdout=log,
      stderr=subprocess.STDOUT,
      env=env,
    )
  wall = time.time() - t0
  print(f'{run_name(replay, corr, seed)} rc={rc} {wall:.0f}s', flush=True)
  if rc == 0:
    with open(os.path.join(workdir, 'done'), 'w') as f:
      f.write(f'{wall:.1f}\n')


def read_run(workdir: str) -> dict[str, float] | None:
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(os.path.join(workdir, 'done')):
    return None
  with open(path) as f:
    rows = [json.loads(line) for line in f]
  rows = [r for r in rows if 'reward/mean' in r]

  def series(key):
    return np.array([r[key] for r in rows if key in r], dtype=np.float64)

  kl = series('rollout_corr/kl')
  reward = series('reward/mean')
  finite = all(
    math.isfinite(v)
    for r in rows
    for v in r.values()
    if isinstance(v, (int, float))
  )
  first, last = reward[:5].mean(), reward[-5:].mean()
  return {
    'kl': kl.mean() if kl.size else math.nan,
    'abs_kl': np.abs(kl).mean() if kl.size else math.nan,
    'agree': series('moe/router_agreement').mean(),
    'differ': series('moe/tokens_differing').mean(),
    'reward': last,
    'collapse': float(not finite or (last < 0.5 * first and last < 0.05)),
  }


def ci(values: list[float]) -> str:
  v = np.array([x for x in values if math.isfinite(x)])
  if v.size == 0:
    return 'n/a'
  m = v.mean()
  if v.size < 2:
    return f'{m:.4g}'
  h = stats.t.ppf(0.975, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size)
  return f'{m:.4g} ± {h:.2g}'


def aggregate(args) -> str:
  keys = ('kl', 'abs_kl', 'agree', 'differ', 'reward')
  lines = [
    '| replay | correction | n | rollout_corr/kl | mean abs kl | '
    'router_agreement | tokens_differing | final reward | collapses |',
    '|---|---|---|---|---|---|---|---|---|',
  ]
  for replay in REPLAYS:
    for corr in CORRECTIONS:
      runs = [
        read_run(os.path.join(args.out, run_name(replay, corr, s)))
        for s in args.seeds
      ]
      runs = [r for r in runs if r is not None]
      if not runs:
        continue
      cells = [ci([r[k] for r in runs]) for k in keys]
      coll = int(sum(r['collapse'] for r in runs))
      lines.append(
        f'| {replay} | {corr} | {len(runs)} | '
        + ' | '.join(cells)
        + f' | {coll} |'
      )
  return '\n'.join(lines)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--out', default='/tmp/moe_lab')
  p.add_argument('--seeds', default='0,1,2')
  p.add_argument('--sft-steps', type=int, default=60)
  p.add_argument('--steps', type=int, default=20)
  p.add_argument('--jobs', type=int, default=1)
  p.add_argument('--aggregate-only', action='store_true')
  args = p.parse_args()
  args.seeds = [int(s) for s in args.seeds.split(',')]
  if not args.aggregate_only:
    cells = [
      (r, c, s) for s in args.seeds for r in REPLAYS for c in CORRECTIONS
    ]
    with ThreadPoolExecutor(args.jobs) as pool:
      list(pool.map(lambda cell: run_one(args, cell), cells))
  print(aggregate(args))


if __name__ == '__main__':
  main()
