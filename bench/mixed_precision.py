"""Mixed precision in a run: a trainer computing in bf16 against float32.

  python bench/mixed_precision.py                 # pulse runs, seeds 0-2
  python bench/mixed_precision.py --seeds=0,1,2,3,4 --steps=6 --out=R.json

Short `configs/arith_tiny.py:pulse+<preset>` runs (a tiny model, a few RL
steps of 4 prompts x 4 samples) with `model.dtype` float32 and bfloat16
(float32 master weights either way), per `train.seed`; the engine computes
in `--engine_dtype` (bfloat16: as on an accelerator, where the engine is
bf16 whatever the trainer). Prints, per trainer dtype, the mean and
standard deviation over the seeds of the correction metrics and the
reward averaged over each run's RL steps, and the bf16 - float32
difference beside the seed spread: what docs/precision.md,
"Mixed-precision training", records.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import jax

from configs import arith_tiny
from jaxcorr.train.loop import Trainer

METRICS = (
  'rollout_corr/k3_kl',
  'rollout_corr/kl',
  'rollout_corr/log_ppl_abs_diff',
  'rollout_corr/rollout_is_mean',
  'rollout_corr/rollout_is_std',
  'rollout_corr/rollout_is_eff_sample_size',
  'actor/pg_clipfrac',
  'actor/entropy',
  'reward/mean',
)


def run_means(args, dtype: str, seed: int) -> dict[str, float]:
  """One run's metrics, each averaged over its RL steps."""
  c = arith_tiny.get_config(f'pulse+{args.preset}')
  c.model.dtype = dtype
  c.rollout.engine_dtype = args.engine_dtype
  c.train.seed = seed
  c.train.num_steps = args.steps
  c.train.eval_every = 0
  c.train.checkpoint_every = 0
  with tempfile.TemporaryDirectory() as workdir:
    trainer = Trainer.from_config(c, workdir, config_name='bench')
    trainer.train()
    with open(f'{workdir}/metrics.jsonl') as f:
      rows = [json.loads(line) for line in f]
    trainer.close()
  rows = [r for r in rows if 'rollout_corr/k3_kl' in r]
  return {
    k: statistics.fmean(r[k] for r in rows)
    for k in METRICS
    if all(k in r for r in rows)
  }


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--seeds', default='0,1,2')
  ap.add_argument('--steps', type=int, default=4)
  ap.add_argument('--preset', default='decoupled_token_is')
  ap.add_argument('--engine_dtype', default='bfloat16')
  ap.add_argument('--out', default='')
  args = ap.parse_args()
  seeds = [int(s) for s in args.seeds.split(',')]
  runs = {
    d: [run_means(args, d, s) for s in seeds] for d in ('float32', 'bfloat16')
  }
  print(
    f'backend {jax.default_backend()}; pulse+{args.preset}, {args.steps} RL '
    f'steps, engine {args.engine_dtype}, seeds {args.seeds}'
  )
  print(f'{"metric":40s} {"float32":>22s} {"bfloat16":>22s} {"bf16-fp32":>10s}')
  for k in runs['float32'][0]:
    col = {}
    for d, rs in runs.items():
      xs = [r[k] for r in rs]
      sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
      col[d] = (statistics.fmean(xs), sd)
    (a, sa), (b, sb) = col['float32'], col['bfloat16']
    print(f'{k:40s} {a:11.4g} ± {sa:8.2g} {b:11.4g} ± {sb:8.2g} {b - a:10.2g}')
  if args.out:
    with open(args.out, 'w') as f:
      json.dump({'args': vars(args), 'runs': runs}, f, indent=1)


if __name__ == '__main__':
  main()
