"""Rollout benchmark: `driver.generate` end to end (prefill, decode, host
work, `RolloutBatch`), this checkout against a baseline checkout, in one run.

Workloads (16 prompts x 4 samples, 32-token prompts, 128 new tokens, the
5M-param Llama-style model below, float32, temperature 1):

  (a) full       no stop tokens: every row runs to max_new_tokens;
  (b) realistic  every 64th token id stops a row: lengths spread from a
                 few tokens to the cap (mean ~45% of it; printed);
  (p) prefill    one new token per row: the batch's prompt prefill and its
                 first sampled token (time to first token). Both sides
                 produce the same 64 tokens, so the tokens/s ratio is the
                 speed ratio of the prefill.

Each implementation runs in its own warm worker process (its checkout
first on PYTHONPATH), and the parent alternates repetitions between them
so both see the same background load; it reports median tokens/s (real
response tokens / wall time) and the median of the per-repetition paired
ratios. The baseline is any checkout of jaxcorr, e.g. the engine before
issue 14:

    git worktree add /tmp/jaxcorr-base aead0c1
    python bench/rollout.py --baseline /tmp/jaxcorr-base

Roofline: with the matmul peak and memory bandwidth measured here, the
bound for (a) is sum over its steps of max(FLOPs / peak, bytes / BW),
where a decode step reads every param and the live KV cache once and does
2 FLOPs per param per row plus attention; the prefill adds 2 FLOPs per
param per prompt token. The engine's (a) throughput is reported as a
fraction of tokens / bound.

Usage: python bench/rollout.py [--baseline DIR] [--reps 5]
       [--decode-chunk 32]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

PROMPTS, SAMPLES, PROMPT_LEN, NEW = 16, 4, 32, 128
MODEL = dict(
  architecture='LlamaForCausalLM',
  vocab_size=4096,
  hidden_size=256,
  intermediate_size=768,
  num_layers=4,
  num_heads=8,
  num_kv_heads=4,
  rope_theta=1e6,
)
STOP_EVERY = 64  # workload (b): ids 0, 64, 128, ... stop a row
WORKLOADS = 'abp'
WARMUP_SEEDS = 4


def train_rows(
  full_length: bool,
  seed: int = 0,
  *,
  rows: int = PROMPTS * SAMPLES,
  new: int = NEW,
  vocab: int = MODEL['vocab_size'],
) -> dict[str, np.ndarray]:
  """One GRPO batch for the update benches (bench/update.py, the train part
  of bench/compare_tunix.py): `rows` rows of PROMPT_LEN prompt ids (>= 1, no
  padding) and up to `new` response ids, lengths spread from 10% to 100% of
  `new` (`full_length`: all at `new`), 0/1 rewards. numpy only (Tunix's
  environment reads it too)."""
  rng = np.random.default_rng(seed)
  b, p, t = rows, PROMPT_LEN, new
  lo = t if full_length else max(1, t // 10)
  rlen = rng.integers(lo, t + 1, b)
  mask = np.arange(t)[None] < rlen[:, None]
  real = np.concatenate([np.ones((b, p), bool), mask], 1)
  tokens = np.where(real, rng.integers(1, vocab, (b, p + t)), 0)
  return dict(
    tokens=tokens.astype(np.int32),
    real=real,
    mask=mask,
    logp=np.where(mask, -rng.uniform(0.1, 3, (b, t)), 0).astype(np.float32),
    reward=rng.integers(0, 2, b).astype(np.float32),
  )


def prompts() -> list[list[int]]:
  rng = np.random.default_rng(0)
  ids = rng.integers(1, MODEL['vocab_size'], (PROMPTS, PROMPT_LEN))
  return ids.tolist()


def stop_ids(workload: str) -> list[int]:
  if workload != 'b':
    return []
  return list(range(0, MODEL['vocab_size'], STOP_EVERY))


def new_tokens(workload: str) -> int:
  return 1 if workload == 'p' else NEW


# ------------------------------------------------------------ workers


def bench_engine(model, decode_chunk: int, **kw):
  """The engine of the workloads above for `model`, every (batch size,
  bucket) variant of (b) compiled up front where the checkout can."""
  from jaxcorr.rollout.engine import PolicyEngine, SamplingParams

  if 'decode_chunk' in inspect.signature(PolicyEngine).parameters:
    kw['decode_chunk'] = decode_chunk
  engine = PolicyEngine(
    model,
    max_concurrent_decodes=PROMPTS * SAMPLES,
    max_prefill_length=PROMPT_LEN,
    max_target_length=PROMPT_LEN + NEW,
    **kw,
  )
  try:
    from jaxcorr.rollout.decoder import Decoder

    Decoder(
      engine,
      sp=SamplingParams(1.0, 0, 1.0, 0.0),
      max_new_tokens=NEW,
      stop_token_ids=stop_ids('b'),
    ).warm_up()
  except (ImportError, AttributeError):  # a checkout without warm_up
    pass
  return engine


def timed_generate(engine, workload: str, seed: int) -> dict:
  """One `driver.generate` of `workload`: its wall and process CPU time,
  real response tokens and per-row lengths."""
  import jax

  from jaxcorr.rollout import driver

  t0, c0 = time.perf_counter(), time.process_time()
  batch = driver.generate(
    engine,
    prompts(),
    num_samples=SAMPLES,
    max_new_tokens=new_tokens(workload),
    stop_token_ids=stop_ids(workload),
    seed=seed,
  )
  jax.block_until_ready(batch.response_tokens)
  secs = time.perf_counter() - t0
  lengths = batch.response_mask.sum(1)
  return dict(
    seconds=secs,
    cpu=time.process_time() - c0,  # every thread's CPU time
    tokens=int(lengths.sum()),
    lengths=lengths.tolist(),
  )


def bench_model():
  """The 5M-param model of the workloads, float32, seed 0."""
  from flax import nnx

  from jaxcorr.model import Transformer, TransformerConfig

  return Transformer(TransformerConfig(**MODEL), rngs=nnx.Rngs(0))


def _jaxcorr_worker(decode_chunk: int) -> None:
  """Serve 'a' / 'b' lines on stdin with one timed driver.generate each."""
  import jaxcorr

  engine = bench_engine(bench_model(), decode_chunk)
  serve(
    lambda w, seed: timed_generate(engine, w, seed),
    name=f'jaxcorr {os.path.dirname(jaxcorr.__file__)}',
  )


def serve(run, name: str) -> None:
  """Worker loop: warm up, then answer 'a <seed>' lines. The warm-up runs
  (b) with several seeds: its lengths decide which (batch size, attention
  bucket) variants compile, and the report is about steady state (a
  trainer compiles each variant once; jaxcorr's worker also compiles them
  all first with `Decoder.warm_up`, so no timed run compiles)."""
  run('a', 0)
  run('p', 0)
  for seed in range(WARMUP_SEEDS):
    run('b', seed)
  print(json.dumps(dict(ready=name)), flush=True)
  for line in sys.stdin:
    w, seed = line.split()
    print(json.dumps(run(w, int(seed))), flush=True)


class Worker:
  """A warm benchmark process speaking one JSON line per request."""

  def __init__(self, label: str, cmd: list[str], cwd: str, env: dict):
    self.label = label
    self.proc = subprocess.Popen(
      cmd,
      cwd=cwd,
      env={**os.environ, **env},
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
    )
    self.name = self._read()['ready']

  def _read(self) -> dict:
    while True:
      line = self.proc.stdout.readline()
      if not line:
        raise RuntimeError(f'worker {self.label} exited')
      if line.startswith('{'):
        return json.loads(line)

  def run(self, workload: str, seed: int) -> dict:
    self.proc.stdin.write(f'{workload} {seed}\n')
    self.proc.stdin.flush()
    return self._read()

  def close(self) -> None:
    self.proc.stdin.close()
    self.proc.wait()


def jaxcorr_worker(label: str, root: str, decode_chunk: int) -> Worker:
  cmd = [sys.executable, os.path.abspath(__file__), '--worker']
  cmd += ['--decode-chunk', str(decode_chunk)]
  return Worker(label, cmd, root, {'PYTHONPATH': root})


def alternate(workers: list[Worker], reps: int) -> dict:
  """{workload: {label: [result per rep]}}, workers interleaved per rep
  (the starting worker rotates so neither always runs first)."""
  out = {w: {k.label: [] for k in workers} for w in WORKLOADS}
  for rep in range(reps):
    for w in WORKLOADS:
      order = workers[rep % len(workers) :] + workers[: rep % len(workers)]
      for k in order:
        out[w][k.label].append(k.run(w, 100 + rep))
  return out


def report(results: dict, new: str, ref: str) -> dict:
  """Print median tok/s per side and the median paired ratio new / ref."""
  summary = {}
  for w, sides in results.items():
    tps = {k: [r['tokens'] / r['seconds'] for r in v] for k, v in sides.items()}
    ratios = [a / b for a, b in zip(tps[new], tps[ref])]
    lengths = np.concatenate([r['lengths'] for r in sides[new]])
    summary[w] = dict(
      new=statistics.median(tps[new]),
      ref=statistics.median(tps[ref]),
      ratio=statistics.median(ratios),
      ratios=ratios,
    )
    print(
      f'({w}) {new}: {summary[w]["new"]:8.0f} tok/s   {ref}: '
      f'{summary[w]["ref"]:8.0f} tok/s   ratio {summary[w]["ratio"]:.2f}x '
      f'(paired: {", ".join(f"{r:.2f}" for r in ratios)}); response '
      f'length mean {lengths.mean() / new_tokens(w):.0%} of cap, min '
      f'{lengths.min()}, max {lengths.max()}'
    )
  return summary


# ----------------------------------------------------------- roofline


def roofline_tokens_per_s() -> tuple[float, str]:
  """Bound on workload (a)'s tokens/s from measured peak and bandwidth."""
  import jax
  import jax.numpy as jnp

  def best(fn, *args):
    fn(*args).block_until_ready()
    times = []
    for _ in range(5):
      t0 = time.perf_counter()
      fn(*args).block_until_ready()
      times.append(time.perf_counter() - t0)
    return min(times)

  n = 1024
  a = jnp.ones((n, n), jnp.float32)
  peak = 2 * n**3 / best(jax.jit(jnp.matmul), a, a)
  x = jnp.ones((64 * 1024 * 1024,), jnp.float32)
  bw = x.nbytes / best(jax.jit(jnp.sum), x)
  m = MODEL
  d, f, v, layers = (
    m['hidden_size'],
    m['intermediate_size'],
    m['vocab_size'],
    m['num_layers'],
  )
  dh = d // m['num_heads']
  per_layer = d * dh * (2 * m['num_heads'] + 2 * m['num_kv_heads']) + 3 * d * f
  matmul_params = layers * per_layer + v * d  # + head; embedding is a gather
  param_bytes = 4 * (layers * per_layer + 2 * v * d)
  rows = PROMPTS * SAMPLES
  total = PROMPTS * PROMPT_LEN * 2 * matmul_params / peak
  for t in range(1, NEW):
    live = PROMPT_LEN + t
    attn = 4 * layers * m['num_heads'] * dh * live * rows
    flops = 2 * matmul_params * rows + attn
    kv_bytes = 2 * 4 * layers * rows * live * m['num_kv_heads'] * dh
    total += max(flops / peak, (param_bytes + kv_bytes) / bw)
  note = f'matmul peak {peak / 1e9:.0f} GFLOP/s, bandwidth {bw / 1e9:.1f} GB/s'
  return rows * NEW / total, note


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument('--worker', action='store_true')
  ap.add_argument('--baseline', default=None, help='another jaxcorr checkout')
  ap.add_argument('--reps', type=int, default=5)
  ap.add_argument('--decode-chunk', type=int, default=32)
  args = ap.parse_args()
  if args.worker:
    _jaxcorr_worker(args.decode_chunk)
    return
  bound, note = roofline_tokens_per_s()
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  workers = [jaxcorr_worker('new', here, args.decode_chunk)]
  if args.baseline:
    workers.append(jaxcorr_worker('base', args.baseline, args.decode_chunk))
  for w in workers:
    print(f'{w.label}: {w.name}')
  try:
    results = alternate(workers, args.reps)
  finally:
    for w in workers:
      w.close()
  if args.baseline:
    summary = report(results, 'new', 'base')
  else:
    summary = report(results, 'new', 'new')
  print(f'roofline (a): {bound:.0f} tok/s ({note})')
  print(f'(a) fraction of the roofline: {summary["a"]["new"] / bound:.2f}')


if __name__ == '__main__':
  main()
