"""Sync vs fixed-lag async vs in-flight streaming: step time, idle time,
tokens/s of the whole RL loop, side by side in one process.

  python bench/async_modes.py    # ~2 min on 2 CPU cores (~1.5 cached)
  python bench/async_modes.py --steps=4 --rounds=2
  python bench/async_modes.py --cpu_devices=2 --rollout_devices=1

Runs the real trainer (`jaxcorr.train.loop.Trainer`, one per mode, same
model, batch, seed and task) with the rollout source each mode builds
(`jaxcorr.train.rollouts.source.make_rollouts`):

  sync     rollout.mode='sync': sample, then update (staleness 0)
  async    rollout.mode='async', max_staleness=1: batch s sampled whole by
           version s - 1 while the trainer updates on batch s - 1
  stream   rollout.mode='stream', max_staleness=2, queue_size=2,
           weight_sync='latest': continuous decoding, new weights swapped
           in between decode chunks while rows are in flight

Modes alternate in rounds (the order rotates each round) so the load of
this shared machine hits all of them alike. Each round gives every mode a
fresh rollout source for `--warm + --steps` RL steps; its first `--warm`
steps fill the pipeline and are dropped, and the source is closed after
the block (outside the timing), so no producer runs while another mode is
measured. The first block of each mode also compiles and is dropped whole.

Per measured step: wall time (`next()` through `publish()`, as
`Trainer._rl_step` times it), trainer idle (time blocked in `next()`
waiting for a batch; in sync mode that is the whole rollout), engine idle
(stream: the producer's own `stream/engine_idle_fraction`; sync: the
update's share of the step; async: 1 - producer busy time / step) and
response tokens trained per wall second. Ideal overlap bound: with rollout
R and update U measured in sync mode, a pipelined step cannot beat
max(R, U), against R + U in sync. On one CPU device the producer thread and
the trainer share the same cores, so the bound is only reachable to the
extent that each phase alone leaves cores idle (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time

import jax
import numpy as np
from absl import logging

from configs import arith_tiny
from jaxcorr.train.loop import Trainer
from jaxcorr.train.rollouts.source import make_rollouts
from jaxcorr.train.tracker.reduction import values

MODES = {
  'sync': {'mode': 'sync'},
  'async': {'mode': 'async', 'max_staleness': 1, 'queue_size': 1},
  'stream': {
    'mode': 'stream',
    'max_staleness': 2,
    'queue_size': 2,
    'weight_sync': 'latest',
  },
}


def make_config(args: argparse.Namespace, mode: str):
  config = arith_tiny.get_config(args.preset)
  config.model.hidden_size = args.hidden
  config.model.intermediate_size = 3 * args.hidden
  config.model.num_layers = args.layers
  config.model.max_position_embeddings = 64
  config.rollout.max_new_tokens = args.new_tokens
  config.rollout.decode_chunk = args.chunk
  config.rollout.prompts_per_step = args.prompts
  config.rollout.samples_per_prompt = 8
  config.rollout.max_concurrent_decodes = 2 * args.prompts * 8
  for field, value in MODES[mode].items():
    config.rollout[field] = value
  if mode != 'sync':
    config.rollout.rollout_devices = args.rollout_devices
  config.train.sft_steps = 0
  config.train.num_steps = 10_000  # sources are built per block
  config.train.eval_every = 0
  config.train.checkpoint_every = 0
  config.train.loggers = 'jsonl'
  config.train.ppo_epochs = args.epochs
  return config


def run_block(trainer: Trainer, steps: int) -> list[dict[str, float]]:
  """`steps` RL steps on a fresh source (closed after, untimed)."""
  source = make_rollouts(
    trainer.run,
    trainer.stage,
    trainer.loader,
    trainer.engine_params,
    start=trainer.step,
  )
  rows = []
  try:
    for _ in range(steps):
      t0 = time.perf_counter()
      scored = source.next()
      t_next = time.perf_counter() - t0
      response = float(np.asarray(scored.batch.response_mask).sum())
      out = trainer.train_on(scored)
      trainer.step += 1
      out.update(values(source.publish(trainer.step)))
      out['bench/step'] = time.perf_counter() - t0
      out['bench/next'] = t_next
      out['bench/response_tokens'] = response
      rows.append(out)
  finally:
    source.close()
  return rows


def engine_idle(mode: str, r: dict[str, float]) -> float:
  if mode == 'stream':
    return r['stream/engine_idle_fraction']
  if mode == 'sync':
    return 1 - r['bench/next'] / r['bench/step']
  busy = r['time/rollout'] + r['time/reward'] + r['time/weight_sync']
  return max(0.0, 1 - busy / r['bench/step'])


def summarise(mode: str, rows: list[dict[str, float]]) -> dict[str, float]:
  med = lambda f: statistics.median(f(r) for r in rows)  # noqa: E731
  step = med(lambda r: r['bench/step'])
  return {
    'step': step,
    'step_min': min(r['bench/step'] for r in rows),
    'step_max': max(r['bench/step'] for r in rows),
    'trainer_idle': med(lambda r: r['bench/next'] / r['bench/step']),
    'engine_idle': med(lambda r: engine_idle(mode, r)),
    # Median of the per-step rates: a rare step that compiles a new decode
    # shape (seconds) would dominate a ratio of sums.
    'tokens_per_s': med(lambda r: r['bench/response_tokens'] / r['bench/step']),
    # sync, async: sampling + scoring one batch (async: in the producer,
    # next to the update); stream: submit to emit, waits included.
    'rollout': med(lambda r: r['time/rollout'] + r['time/reward']),
    'update': med(
      lambda r: r['bench/step'] - r['bench/next']
    ),  # prepare + update + publish: the trainer's own work
    'staleness': med(lambda r: r.get('rollout/staleness_mean', 0.0)),
    'mixed': med(lambda r: r.get('rollout/mixed_version_fraction', 0.0)),
  }


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--steps', type=int, default=6, help='measured per block')
  ap.add_argument('--warm', type=int, default=2, help='dropped per block')
  ap.add_argument('--rounds', type=int, default=5)
  ap.add_argument('--preset', default='decoupled_token_is')
  ap.add_argument('--hidden', type=int, default=128)
  ap.add_argument('--layers', type=int, default=2)
  ap.add_argument('--prompts', type=int, default=4)
  ap.add_argument('--new_tokens', type=int, default=32)
  ap.add_argument('--chunk', type=int, default=1)
  ap.add_argument('--epochs', type=int, default=1)
  ap.add_argument(
    '--cpu_devices',
    type=int,
    default=1,
    help='virtual CPU devices (XLA --xla_force_host_platform_device_count); '
    'they share the same cores',
  )
  ap.add_argument(
    '--rollout_devices',
    type=int,
    default=0,
    help="async, stream: devices of the engine's own sub-mesh (0: shared "
    'with the trainer); sync always uses every device',
  )
  ap.add_argument(
    '--cache',
    default=os.path.join(tempfile.gettempdir(), 'jaxcorr_bench_cache'),
    help="JAX's persistent compilation cache ('' = off): the modes share "
    'most programs, so each compiles once',
  )
  args = ap.parse_args()
  if args.cpu_devices > 1:
    # Read when the backend starts (the first jax.devices()), not at import.
    os.environ['XLA_FLAGS'] = (
      os.environ.get('XLA_FLAGS', '')
      + f' --xla_force_host_platform_device_count={args.cpu_devices}'
    )
  if args.cache:
    jax.config.update('jax_compilation_cache_dir', args.cache)
    # The defaults skip the small, quickly compiled programs of this model.
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
    jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO

  rows = {m: [] for m in MODES}
  with tempfile.TemporaryDirectory() as tmp:
    trainers = {
      m: Trainer.from_config(make_config(args, m), f'{tmp}/{m}', config_name=m)
      for m in MODES
    }
    for t in trainers.values():
      t.save(force=True)  # step 0, as train() would
    order = list(MODES)
    for m in order:  # compile every mode's steps; not measured
      run_block(trainers[m], args.warm + 1)
    t_all = time.perf_counter()
    for rnd in range(args.rounds):
      for m in order[rnd % 3 :] + order[: rnd % 3]:
        block = run_block(trainers[m], args.warm + args.steps)
        rows[m] += block[args.warm :]
        print(
          f'round {rnd} {m:6s} step '
          + ' '.join(f'{r["bench/step"]:.2f}' for r in block)
          + ' s',
          flush=True,
        )
    wall = time.perf_counter() - t_all
    for t in trainers.values():
      t.close()

  res = {m: summarise(m, rows[m]) for m in MODES}
  sync = res['sync']
  t = trainers['sync'].run
  print(
    f'\nbackend {jax.default_backend()} x{jax.device_count()} (engine '
    f'devices in async/stream: {args.rollout_devices or "shared"}); model '
    f'D={args.hidden} L={args.layers}; batch {args.prompts} x 8, '
    f'{args.new_tokens} new tokens, decode_chunk {args.chunk}; preset '
    f'{args.preset}, ppo_epochs {t.train.ppo_epochs}; {args.rounds} rounds '
    f'x {args.steps} measured steps per mode ({wall:.0f} s)'
  )
  print(
    '\nmode    step s [min-max]      vs sync  trainer idle  engine idle'
    '  resp tok/s  vs sync  trainer work s  rollout s  staleness'
    '  mixed rows'
  )
  for m, r in res.items():
    print(
      f'{m:7s} {r["step"]:.3f} [{r["step_min"]:.2f}-{r["step_max"]:.2f}]'
      f'    {r["step"] / sync["step"]:5.2f}x  {r["trainer_idle"]:11.0%}'
      f'  {r["engine_idle"]:11.0%}  {r["tokens_per_s"]:10.0f}'
      f'  {r["tokens_per_s"] / sync["tokens_per_s"]:6.2f}x'
      f'  {r["update"]:14.3f}'
      f'  {r["rollout"] if m != "stream" else math.nan:9.3f}'
      f'  {r["staleness"]:9.2f}  {r["mixed"]:10.0%}'
    )
  R, U = sync['rollout'], sync['update']
  print(
    f'\nsync phases: rollout+reward R = {R:.3f} s, trainer work U = '
    f'{U:.3f} s (prepare, update, publish); sync bound R + U = '
    f'{R + U:.3f} s, ideal overlap max(R, U) = {max(R, U):.3f} s '
    f'({max(R, U) / (R + U):.2f}x of R + U)'
  )
  for m in ('async', 'stream'):
    r = res[m]
    print(
      f'{m}: {r["step"]:.3f} s/step = {r["step"] / max(R, U):.2f}x the '
      f'ideal max(R, U); saves {sync["step"] - r["step"]:+.3f} s/step of '
      f'the ideal {min(R, U):.3f} (= min(R, U)); its trainer work '
      f'{r["update"]:.3f} s vs {U:.3f} s in sync (contention)'
    )


if __name__ == '__main__':
  main()
