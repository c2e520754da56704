"""What the KV-cache choice after an in-flight weight swap costs in
mismatch and in time (`rollout.kv_on_update`: keep vs recompute).

  python bench/inflight_kv.py              # ~5 minutes on a 2-core CPU
  python bench/inflight_kv.py --steps=12 --seeds=0,1,2

Two streaming runs per seed of the arithmetic task (`configs/arith_tiny.py`
after its SFT warm-up, `rollout.mode='stream'`, max_staleness=2,
queue_size=2, `weight_sync='scheduled'`, small decode chunks so rows span
several swaps), one per choice. Scheduled swaps are a function of the
producer's progress, so both runs of a seed swap at the same points, and
their rows match token for token until the first token a swap touches.
Reported per choice: the rollout/trainer mismatch split by version gap
(`rollout_corr/gap<g>/kl` and `k3_kl` of the decoupled correction: the
trainer's π_old against the engine's recorded μ, per token), the
whole-batch `rollout_corr/kl`, the fraction of mixed-version rows, and the
producer's swap time (`time/weight_sync`, where recompute's forward over
the live rows lands).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile

from configs import arith_tiny
from jaxcorr.train.loop import Trainer

KEYS = (
  'rollout_corr/kl',
  'rollout_corr/gap0/kl',
  'rollout_corr/gap1/kl',
  'rollout_corr/gap2/kl',
  'rollout_corr/gap0/k3_kl',
  'rollout_corr/gap1/k3_kl',
  'rollout_corr/gap2/k3_kl',
  'rollout_corr/gap1/token_fraction',
  'rollout_corr/gap2/token_fraction',
  'rollout/mixed_version_fraction',
  'time/weight_sync',
)


def run(kv: str, seed: int, steps: int, workdir: pathlib.Path) -> list[dict]:
  c = arith_tiny.get_config('decoupled_token_is')
  c.rollout.mode = 'stream'
  c.rollout.max_staleness = 2
  c.rollout.queue_size = 2
  c.rollout.weight_sync = 'scheduled'
  c.rollout.kv_on_update = kv
  c.rollout.decode_chunk = 2
  c.train.seed = seed
  c.model.init_seed = seed
  c.train.num_steps = steps
  c.train.eval_every = 0
  c.train.checkpoint_every = 0
  c.train.loggers = 'jsonl'
  trainer = Trainer.from_config(c, str(workdir), config_name='bench')
  trainer.train()
  trainer.close()
  with open(workdir / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f]
  return [r for r in rows if r['step'] > 1]  # step 1 compiles


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--steps', type=int, default=8)
  ap.add_argument('--seeds', default='0')
  args = ap.parse_args()
  seeds = [int(s) for s in args.seeds.split(',')]
  table: dict[str, dict[str, list[float]]] = {}
  with tempfile.TemporaryDirectory() as tmp:
    for seed in seeds:
      for kv in ('keep', 'recompute'):
        rows = run(kv, seed, args.steps, pathlib.Path(tmp) / f'{kv}{seed}')
        cell = table.setdefault(kv, {k: [] for k in KEYS})
        for k in KEYS:
          cell[k] += [r[k] for r in rows if k in r]
  print(
    f'{len(seeds)} seed(s) x {args.steps - 1} measured steps each; '
    'means over steps and seeds'
  )
  print(f'{"metric":36s} {"keep":>12s} {"recompute":>12s}')
  for k in KEYS:
    vals = [table[kv][k] for kv in ('keep', 'recompute')]
    cells = [
      f'{statistics.fmean(v):12.3e}' if v else f'{"-":>12s}' for v in vals
    ]
    print(f'{k:36s} {cells[0]} {cells[1]}')


if __name__ == '__main__':
  main()
