"""jaxcorr's `driver.generate` side by side with Tunix's `Sampler`, the JAX
library a user would pick instead (not run in CI).

Same shapes on both sides (`bench/rollout.py`'s workloads: 16 prompts x 4
samples, 32-token prompts, 128 new tokens, a 5M-param Llama-style model,
float32, temperature 1, no truncation): (a) every row runs to the cap,
(b) every 64th token id stops a row, (p) one new token per row: the
prefill and the first sample (time to first token). Tunix gets each
prompt 4 times (it has no samples-per-prompt knob); its ids-as-text
tokenizer keeps pad and (for (a)) eos outside the vocabulary so nothing
stops a row early. Its
weights are its own random init (timing does not depend on the values);
response lengths of both sides are printed for (b).

`--part=train` compares the update step instead: one GRPO optimizer step
on 64 rows x (32 prompt + 128 response tokens) of the same model, (full)
every response at the cap and (realistic) lengths spread from 10% to 100%
of it (bench/update.py's batch). Tunix: `algo_core.grpo_loss_fn` (its GRPO
loss on the full `[B, T, V]` logits, beta 0, one iteration: π_old is the
current policy) under one `nnx.jit` step with AdamW. jaxcorr:
`Steps.prepare` + `Steps.update` with `bypass_ppo_clip` (π_old = μ, no
extra forward), one mini- and micro-batch, packed (`train.packing`) and
padded. Both report real (prompt + response) tokens per second.

Tunix lives in its own environment (its pins differ from jaxcorr's):

    python -m venv /work/tunix-venv
    /work/tunix-venv/bin/pip install google-tunix==0.1.7 'jax[cpu]'
    python bench/compare_tunix.py --tunix-python /work/tunix-venv/bin/python

(or `pip install -e .[bench]` where one environment can hold both). Both
sides run in warm worker processes, alternating repetitions; the report
gives median tokens/s and the median paired ratio.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import time
import types

import numpy as np
import rollout as bench  # bench/rollout.py: workloads, workers, report


class _IdTokenizer:
  """Space-separated ids; bos 0 (= none), pad and eos past the vocab."""

  def __init__(self, vocab: int):
    self.vocab = vocab

  def encode(self, text: str, **kwargs) -> list[int]:
    del kwargs
    return [int(t) for t in text.split()]

  def decode(self, ids, **kwargs) -> str:
    del kwargs
    return ' '.join(str(int(t)) for t in ids)

  def bos_id(self) -> int:
    return 0

  def eos_id(self) -> int:
    return self.vocab + 2

  def pad_id(self) -> int:
    return self.vocab + 1


def _tunix_worker() -> None:
  import jax
  from flax import nnx
  from tunix.generate import sampler as sampler_lib
  from tunix.models.llama3 import model as llama3

  m = bench.MODEL
  config = llama3.ModelConfig(
    num_layers=m['num_layers'],
    vocab_size=m['vocab_size'],
    embed_dim=m['hidden_size'],
    hidden_dim=m['intermediate_size'],
    num_heads=m['num_heads'],
    head_dim=m['hidden_size'] // m['num_heads'],
    num_kv_heads=m['num_kv_heads'],
    rope_theta=int(m['rope_theta']),
    norm_eps=1e-6,
  )
  model = llama3.Llama3(config, rngs=nnx.Rngs(0))
  tok = _IdTokenizer(m['vocab_size'])
  sampler = sampler_lib.Sampler(
    model,
    tok,
    sampler_lib.CacheConfig(
      cache_size=bench.PROMPT_LEN + bench.NEW,
      num_layers=config.num_layers,
      num_kv_heads=config.num_kv_heads,
      head_dim=config.head_dim,
    ),
  )
  texts = [tok.decode(p) for p in bench.prompts() for _ in range(bench.SAMPLES)]

  def run(workload: str, seed: int) -> dict:
    stop = bench.stop_ids(workload) or [tok.eos_id()]
    t0 = time.perf_counter()
    out = sampler(
      texts,
      max_generation_steps=bench.new_tokens(workload),
      max_prompt_length=bench.PROMPT_LEN,
      return_logprobs=True,
      eos_tokens=stop,
      temperature=1.0,
      top_p=1.0,
      seed=seed,
    )
    jax.block_until_ready(out.logprobs)
    secs = time.perf_counter() - t0
    # Tunix cuts each row before its eos; jaxcorr keeps the stop token in
    # the response: count it on Tunix's side too.
    lengths = [min(len(t) + 1, bench.new_tokens(workload)) for t in out.tokens]
    return dict(seconds=secs, tokens=int(sum(lengths)), lengths=lengths)

  bench.serve(run, name=f'tunix {sampler_lib.__file__}')


TRAIN_WORKLOADS = ('full', 'realistic')


def _train_serve(run, name: str, loads: list[str]) -> None:
  """Worker loop of the train part: compile and warm the workloads, then
  answer '<workload> <seed>' lines with one JSON line each."""
  for w in loads:  # compiles: every later call has its shapes
    run(w, 0)
  print(json.dumps(dict(ready=name)), flush=True)
  for line in sys.stdin:
    w, seed = line.split()
    print(json.dumps(run(w, int(seed))), flush=True)


def _tunix_train_worker(loads: list[str]) -> None:
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx
  from tunix.models.llama3 import model as llama3
  from tunix.rl import algo_core, common
  from tunix.rl.grpo import grpo_learner

  m = bench.MODEL
  config = llama3.ModelConfig(
    num_layers=m['num_layers'],
    vocab_size=m['vocab_size'],
    embed_dim=m['hidden_size'],
    hidden_dim=m['intermediate_size'],
    num_heads=m['num_heads'],
    head_dim=m['hidden_size'] // m['num_heads'],
    num_kv_heads=m['num_kv_heads'],
    rope_theta=int(m['rope_theta']),
    norm_eps=1e-6,
  )
  model = llama3.Llama3(config, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adamw(1e-5), wrt=nnx.Param)
  # grpo_loss_fn reads `temperature`, which 0.1.7's GRPOConfig lacks (its
  # learner passes a config that has it): the same fields plus T = 1.
  algo = types.SimpleNamespace(
    **vars(grpo_learner.GRPOConfig(beta=0.0, num_generations=bench.SAMPLES)),
    temperature=1.0,
  )
  pad, eos = 0, m['vocab_size'] - 1  # synthetic ids are >= 1

  @nnx.jit
  def step(model, opt, ex):
    def loss(mod):
      return algo_core.grpo_loss_fn(mod, ex, algo, pad, eos)

    (val, _), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    opt.update(model, grads)
    return val

  examples = {}
  for w in loads:
    b = bench.train_rows(full_length=w == 'full')
    p = bench.PROMPT_LEN
    adv = np.where(b['reward'] > 0, 1.0, -1.0).astype(np.float32)
    examples[w] = common.TrainExample(
      prompt_ids=jnp.asarray(b['tokens'][:, :p]),
      prompt_mask=jnp.asarray(b['real'][:, :p]),
      completion_ids=jnp.asarray(b['tokens'][:, p:]),
      completion_mask=jnp.asarray(b['mask']),
      advantages=jnp.asarray(adv),
      ref_per_token_logps=None,
      old_per_token_logps=None,
    )

  def run(workload: str, seed: int) -> dict:
    del seed
    ex = examples[workload]
    t0 = time.perf_counter()
    jax.block_until_ready(step(model, opt, ex))
    real = int(ex.prompt_mask.sum() + ex.completion_mask.sum())
    return dict(seconds=time.perf_counter() - t0, tokens=real, lengths=[])

  _train_serve(run, 'tunix grpo_loss_fn', loads)


def _jaxcorr_train_worker(packing: bool, loads: list[str]) -> None:
  import update  # bench/update.py

  args = update.parser().parse_args(
    ['--preset=bypass_ppo_clip', '--micro-batches=1']
  )
  sides = {
    w: update.Side(args, packing, update.synthetic_batch(w == 'full'))
    for w in loads
  }

  def run(workload: str, seed: int) -> dict:
    del seed
    s = sides[workload]
    t = s.step()
    real = int(s.host.segment_ids.sum())
    return dict(seconds=t['total'], tokens=real, lengths=[])

  _train_serve(run, f'jaxcorr packing={packing}', loads)


def train_main(args) -> None:
  """The train part (module docstring): alternating warm workers."""
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  path = {'PYTHONPATH': f'{here}:{os.path.join(here, "bench")}'}
  me = os.path.abspath(__file__)
  flag = f'--workloads={args.workloads}'
  specs = [
    (f'jaxcorr {side}', [sys.executable, me, f'--worker=jaxcorr_{side}'])
    for side in args.sides.split(',')
  ]
  specs.append(('tunix', [args.tunix_python, me, '--worker=tunix_train']))
  specs = [(label, [*cmd, flag]) for label, cmd in specs]
  # The workers compile and warm up side by side; the timed runs alternate.
  with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
    workers = list(
      pool.map(lambda s: bench.Worker(s[0], s[1], here, path), specs)
    )
  loads = args.workloads.split(',')
  out = {w: {k.label: [] for k in workers} for w in loads}
  try:
    for rep in range(args.reps):
      for w in loads:
        r = rep % len(workers)
        order = workers[r:] + workers[:r]
        for k in order:
          out[w][k.label].append(k.run(w, rep))
  finally:
    for k in workers:
      k.close()
  for w, sides in out.items():
    tps = {k: [r['tokens'] / r['seconds'] for r in v] for k, v in sides.items()}
    for k, v in tps.items():
      print(
        f'({w}) {k:15s} median {statistics.median(v):7.0f} tok/s '
        f'[{min(v):.0f}-{max(v):.0f}]'
      )
    for k in (k for k in tps if k != 'tunix'):
      ratios = [a / b for a, b in zip(tps[k], tps['tunix'])]
      print(
        f'({w}) {k} / tunix: median {statistics.median(ratios):.2f}x '
        f'(paired: {", ".join(f"{r:.2f}" for r in ratios)})'
      )
  sys.stdout.flush()


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument('--part', choices=('rollout', 'train'), default='rollout')
  ap.add_argument('--workloads', default=','.join(TRAIN_WORKLOADS))
  ap.add_argument('--sides', default='packed,padded')
  ap.add_argument('--worker', nargs='?', const='tunix', default=None)
  ap.add_argument('--tunix-python', default='/work/tunix-venv/bin/python')
  ap.add_argument('--reps', type=int, default=5)
  ap.add_argument('--decode-chunk', type=int, default=32)
  args = ap.parse_args()
  if args.worker == 'tunix':
    _tunix_worker()
    return
  loads = args.workloads.split(',')
  if args.worker == 'tunix_train':
    _tunix_train_worker(loads)
    return
  if args.worker in ('jaxcorr_packed', 'jaxcorr_padded'):
    _jaxcorr_train_worker(args.worker == 'jaxcorr_packed', loads)
    return
  if args.part == 'train':
    train_main(args)
    return
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  workers = [bench.jaxcorr_worker('jaxcorr', here, args.decode_chunk)]
  workers.append(
    bench.Worker(
      'tunix',
      [args.tunix_python, os.path.abspath(__file__), '--worker'],
      here,
      {'PYTHONPATH': os.path.dirname(os.path.abspath(__file__))},
    )
  )
  for w in workers:
    print(f'{w.label}: {w.name}')
  try:
    results = bench.alternate(workers, args.reps)
  finally:
    for w in workers:
      w.close()
  bench.report(results, 'jaxcorr', 'tunix')
  for w, sides in results.items():
    tl = np.concatenate([r['lengths'] for r in sides['tunix']])
    cap = bench.new_tokens(w)
    print(f'({w}) tunix response length mean {tl.mean() / cap:.0%}')
  sys.stdout.flush()


if __name__ == '__main__':
  main()
