"""Trainer step-time breakdown, tokens/s and FLOP utilisation.

  python bench/train.py                 # ~2 minutes on a 2-core CPU
  python bench/train.py --steps=8 --preset=bypass_pg_is

Runs the real trainer (`jaxcorr.train.loop.Trainer` with a
`SyncRollouts` source: JetStream engine, rewards, prepare, update, weight
sync) on the arithmetic task with a model from scratch and no SFT, so
responses run to `max_new_tokens` and every step has the same shape. The
first step (compilation) is dropped. For each measured step it prints the
wall time of each phase, and the FLOP rate of the phases that are
matmul-bound (prepare: one forward for π_old; update: forward + backward)
as a fraction of a dense-matmul peak measured right before that step (this
machine is shared: peak and step see the same load).

The update alone, packed (`train.packing`) vs padded rows on realistic
response lengths, with its prepare/update/host split: bench/update.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from configs import arith_tiny
from jaxcorr.train.loop import Trainer
from jaxcorr.train.policy import transformer_config
from jaxcorr.train.rollouts.source import SyncRollouts
from jaxcorr.train.tracker.reduction import values


def best_time(f, *args, reps: int = 3, calls: int = 1) -> float:
  """Best wall time of one `jax.jit(f)(*args)` call (s), over `reps` warm
  timings of `calls` calls dispatched back to back.

  With `calls > 1` the launches queue behind each other, so a product that
  runs for tens of microseconds on an accelerator is timed as the device
  runs it, not with one dispatch round trip added to each call.
  """
  f = jax.jit(f)
  jax.block_until_ready(f(*args))
  best = float('inf')
  for _ in range(reps):
    t0 = time.perf_counter()
    outs = [f(*args) for _ in range(calls)]
    jax.block_until_ready(outs)
    best = min(best, (time.perf_counter() - t0) / calls)
  return best


def matmul_peak(n: int | None = None, reps: int = 3) -> float:
  """Best FLOP/s of an n³ float32 matmul (the machine's dense peak now).

  n defaults to 1024 on CPU and 8192 on an accelerator, where a 1024³
  product is launch-bound and would understate the peak ~10x.
  """
  if n is None:
    n = 1024 if jax.default_backend() == 'cpu' else 8192
  a = jnp.ones((n, n), jnp.float32)
  return 2 * n**3 / best_time(lambda x: x @ x, a, reps=reps)


def flops_per_token(cfg, seq: int) -> float:
  """Forward FLOPs per token: 2 x matmul params + attention (2 x 2 L H Dh S)."""
  n = cfg.num_params() - cfg.num_layers * 2 * cfg.hidden_size
  if not cfg.tie_embeddings:
    # The input embedding is a gather, not a matmul (tied: counted once,
    # as the head).
    n -= cfg.vocab_size * cfg.hidden_size
  attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq
  return 2 * n + attn


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--steps', type=int, default=6)
  ap.add_argument('--preset', default='decoupled_geo_rs')
  ap.add_argument('--hidden', type=int, default=256)
  ap.add_argument('--layers', type=int, default=4)
  ap.add_argument('--new_tokens', type=int, default=24)
  args = ap.parse_args()

  config = arith_tiny.get_config(args.preset)
  config.model.hidden_size = args.hidden
  config.model.intermediate_size = 4 * args.hidden
  config.model.num_layers = args.layers
  config.model.max_position_embeddings = 64
  config.rollout.max_new_tokens = args.new_tokens
  config.rollout.prompts_per_step = 16
  config.rollout.samples_per_prompt = 8
  config.train.sft_steps = 0
  config.train.num_steps = args.steps + 1
  config.train.eval_every = 0
  config.train.checkpoint_every = 0
  config.train.loggers = 'jsonl'
  with tempfile.TemporaryDirectory() as workdir:
    trainer = Trainer.from_config(config, workdir)
    cfg = transformer_config(trainer.run.model)
    rows = []
    trainer.save(force=True)
    source = SyncRollouts(
      trainer.stage, trainer.loader, trainer.engine_params, start=0
    )
    for s in range(args.steps + 1):
      peak = matmul_peak()
      t0 = time.perf_counter()
      out = trainer.train_on(source.next())
      trainer.step += 1
      out.update(values(source.publish(trainer.step)))
      out['time/step'] = time.perf_counter() - t0
      out['peak'] = peak
      if s:  # step 0 compiles
        rows.append(out)
    trainer.close()

  seq = config.rollout.max_prompt_length + config.rollout.max_new_tokens
  fpt = flops_per_token(cfg, seq)
  print(
    f'backend: {jax.default_backend()} x{jax.device_count()}, '
    f'jax {jax.__version__}'
  )
  print(
    f'model: {cfg.num_params() / 1e6:.2f}M params, D={cfg.hidden_size} '
    f'L={cfg.num_layers}; batch {config.rollout.prompts_per_step} x '
    f'{config.rollout.samples_per_prompt}, {args.new_tokens} new tokens; '
    f'preset {args.preset}; {len(rows)} steps after compilation'
  )
  med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
  step = med('time/step')
  print('\nphase                 median s   share of step')
  for k in (
    'time/rollout',
    'time/reward',
    'time/prepare',
    'time/update',
    'time/weight_sync',
  ):
    print(f'  {k:20s} {med(k):8.3f}   {med(k) / step:6.1%}')
  print(f'  {"time/step":20s} {step:8.3f}')
  tokens = med('perf/train_tokens')
  print(
    f'\ntrain tokens/s (prompt + response, whole step): {tokens / step:.0f}'
  )
  # prepare: a forward over every position; update: forward + backward
  # (x3) per epoch; the row count includes padding the trainer computes.
  rows_total = trainer.run.rollout.batch_size
  pos = rows_total * seq
  fracs = []
  for r in rows:
    flops = fpt * pos * (1 + 3 * trainer.run.train.ppo_epochs)
    rate = flops / (r['time/prepare'] + r['time/update'])
    fracs.append(rate / r['peak'])
  print(
    f'prepare+update FLOP rate / dense-matmul peak (same run): median '
    f'{statistics.median(fracs):.1%} [{min(fracs):.1%}-{max(fracs):.1%}], '
    f'peak {statistics.median(r["peak"] for r in rows) / 1e9:.1f} GFLOP/s'
  )
  roll = fpt * rows_total * seq / med('time/rollout')
  print(
    f'rollout FLOP rate / peak: {roll / med("peak"):.1%} (decode is '
    'memory- and dispatch-bound; see docs/rollout.md)'
  )


if __name__ == '__main__':
  sys.exit(main())
