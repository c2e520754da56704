"""Exact mode's cost (issue 39 item 2): rollout tokens/s and the update's
time with `rollout.exact` on and off, in one process, alternating
repetitions so both sides see the same background load.

  python bench/exact.py                       # both parts, 5 reps each
  python bench/exact.py --parts=rollout --reps=9
  python bench/exact.py --parts=rollout --tiles=8,16,32,64

rollout  `driver.generate` end to end on bench/rollout.py's workloads (a:
         16 prompts x 4 samples, 32-token prompts, 128 new tokens, no
         stops; b: realistic lengths; p: prefill + first token) and its
         5M-param float32 model, two engines on the same weights:
         `PolicyEngine(exact=False)` and `exact=True`. Reported as
         bench/rollout.py reports a baseline: median tokens/s per side and
         the median of the per-repetition paired ratios exact / off.
         `--tiles`: the same with exact mode's token tile
         (`jaxcorr.model.exact.TILE`) set to each value, an experiment on
         where the time goes, not a setting.
update   `Steps.prepare` + `Steps.update` of bench/update.py (the same
         synthetic GRPO batch, preset decoupled_geo_rs, padded rows) with
         `rollout.exact` off and on: exact mode changes π_old's forward in
         prepare (the exact forward over the engine's cache extent); the
         update's π_θ keeps the fast path. Median seconds of prepare,
         update and the step per side, and the paired ratio exact / off.

Both parts also report process CPU time (every thread's), the work done:
on a shared machine wall time follows the neighbours' load, CPU time much
less.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import rollout as bench  # bench/rollout.py: workloads, engine, report
import update  # bench/update.py: the synthetic batch and one step's Side

from jaxcorr.model import exact as exact_mode


class EngineSide:
  """One engine, as `bench.alternate` drives it (label, run)."""

  def __init__(self, label: str, engine):
    self.label = label
    self.engine = engine
    # Steady state only: (a), (p) and the lengths of (b) compiled first,
    # as bench/rollout.py's workers warm up.
    for w, seeds in (('a', 1), ('p', 1), ('b', bench.WARMUP_SEEDS)):
      for seed in range(seeds):
        self.run(w, seed)

  def run(self, workload: str, seed: int) -> dict:
    return bench.timed_generate(self.engine, workload, seed)


def set_tile(tile: int) -> None:
  """Exact mode's token tile for engines built from now on (the default
  argument of `token_tiles`, which every exact op calls)."""
  exact_mode.token_tiles.__defaults__ = (tile,)


def rollout_part(reps: int, decode_chunk: int, tiles: list[int]) -> dict:
  """Exact on vs off per workload; with `tiles`, one exact engine per tile."""
  model = bench.bench_model()
  sides = [EngineSide('off', bench.bench_engine(model, decode_chunk))]
  default = exact_mode.TILE
  for tile in tiles or [default]:
    set_tile(tile)
    engine = bench.bench_engine(model, decode_chunk, exact=True)
    label = 'exact' if not tiles else f'exact_tile{tile}'
    sides.append(EngineSide(label, engine))
  set_tile(default)
  results = bench.alternate(sides, reps)
  out = {}
  for s in sides[1:]:
    got = {w: {k: v[k] for k in (s.label, 'off')} for w, v in results.items()}
    print(f'-- {s.label} against off (tile {s.label[10:] or default}), wall')
    out[s.label] = bench.report(got, s.label, 'off')
    # Process CPU time (all threads): the work done, much less sensitive
    # than wall time to what else runs on a shared machine.
    print(f'-- {s.label} against off, CPU time (tokens per CPU-second)')
    cpu = {
      w: {k: [dict(r, seconds=r['cpu']) for r in rs] for k, rs in v.items()}
      for w, v in got.items()
    }
    out[s.label + '_cpu'] = bench.report(cpu, s.label, 'off')
  return out


def update_part(reps: int) -> dict:
  """prepare + update with exact off and on, alternating repetitions."""
  args = update.parser().parse_args([])
  host = update.synthetic_batch(args.full_length)
  sides = {
    'off': update.Side(args, False, host),
    'exact': update.Side(args, False, host, sets={'rollout.exact': True}),
  }
  for s in sides.values():  # compile
    s.step()
  results = {k: [] for k in sides}
  names = list(sides)
  for rep in range(reps):
    for name in names[rep % 2 :] + names[: rep % 2]:
      c0 = time.process_time()
      r = sides[name].step()
      results[name].append(dict(r, cpu=time.process_time() - c0))
  med = statistics.median
  for name, rs in results.items():
    parts = '  '.join(f'{k} {med(r[k] for r in rs):.3f}s' for k in rs[0])
    print(f'{name:6s} {parts}')
  summary = {}
  for key in ('prepare', 'update', 'total', 'cpu'):
    pairs = [a[key] / b[key] for a, b in zip(results['exact'], results['off'])]
    summary[key] = med(pairs)
    print(
      f'exact / off {key}: median {med(pairs):.2f}x '
      f'[{min(pairs):.2f}-{max(pairs):.2f}] (paired per repetition)'
    )
  return summary


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--reps', type=int, default=5)
  ap.add_argument('--parts', default='rollout,update')
  ap.add_argument('--decode-chunk', type=int, default=32)
  ap.add_argument(
    '--tiles', default='', help='exact engines with these tiles, e.g. 8,32'
  )
  args = ap.parse_args()
  print(
    f'backend: {jax.default_backend()} x{jax.device_count()} '
    f'({jax.devices()[0].device_kind}), jax {jax.__version__}; '
    f'exact TILE {exact_mode.TILE}'
  )
  parts = args.parts.split(',')
  if 'rollout' in parts:
    tiles = [int(t) for t in args.tiles.split(',') if t]
    rollout_part(args.reps, args.decode_chunk, tiles)
  if 'update' in parts:
    update_part(args.reps)


if __name__ == '__main__':
  sys.exit(main())
