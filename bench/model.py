"""Model benchmark (issue: the Flax policy).

Measures, in one run (the machine is shared and noisy, so only numbers taken
in the same run are compared):

  (a) forward + backward training throughput (tokens/s) of a ~25M-param
      Llama-style config at sequence length 512, loss = mean token_logprobs;
  (b) its achieved FLOP/s as a fraction of a dense-matmul peak measured
      right before each step (the best of 5 jitted [2048, 2048] @ [2048, 2048]
      products in the same dtype); model FLOPs are the usual
      6 N + 12 L H Dh S per token (N = matmul params incl. the LM head;
      attention at full S);
  (c) peak memory of `token_logprobs` vs the naive full-logits version at
      V = 151936 (Qwen's vocabulary), forward and forward + backward, from
      XLA's compiled memory analysis (arguments + outputs + temporaries), and
      one timed run of each forward.

Usage: python bench/model.py [--batch 4] [--seq 512] [--steps 5]
       [--dtype float32] [--skip-memory]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcorr.model import (
  Transformer,
  TransformerConfig,
  naive_token_logprobs,
  token_logprobs,
)

BENCH_CONFIG = TransformerConfig(
  vocab_size=8192,
  hidden_size=512,
  intermediate_size=1408,
  num_layers=7,
  num_heads=8,
  num_kv_heads=4,
  tie_embeddings=True,
)


def matmul_peak(dtype, n: int = 2048, reps: int = 5) -> float:
  """Best FLOP/s of a jitted [n, n] @ [n, n] in `dtype`."""
  a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), dtype)
  f = jax.jit(lambda a, b: a @ b)
  f(a, a).block_until_ready()
  best = float('inf')
  for _ in range(reps):
    t = time.perf_counter()
    f(a, a).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return 2 * n**3 / best


def model_flops_per_token(cfg: TransformerConfig, seq: int) -> float:
  """Training (fwd + bwd) FLOPs per token: 6 N_matmul + 12 L H Dh S."""
  n = cfg.num_params() - cfg.vocab_size * cfg.hidden_size  # no gather FLOPs
  n += cfg.vocab_size * cfg.hidden_size  # the head matmul (tied or not)
  n -= cfg.num_layers * 2 * cfg.hidden_size + cfg.hidden_size  # norms
  attn = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq
  return 6 * n + attn


def train_throughput(cfg, batch, seq, steps):
  """Per step: (seconds, matmul peak FLOP/s measured right before it).

  Peak and step alternate, so both see the same background load (this
  machine is shared; a peak taken at a quiet moment against steps taken
  under load would understate the fraction, and vice versa).
  """
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  tokens = jnp.asarray(
    np.random.default_rng(1).integers(0, cfg.vocab_size, (batch, seq + 1))
  )

  @jax.jit
  def step(state, tokens):
    def loss(state):
      return -token_logprobs(nnx.merge(graphdef, state), tokens).mean()

    return jax.value_and_grad(loss)(state)

  jax.block_until_ready(step(state, tokens))
  out = []
  for _ in range(steps):
    peak = matmul_peak(cfg.dtype, reps=5)
    t = time.perf_counter()
    jax.block_until_ready(step(state, tokens))
    out.append((time.perf_counter() - t, peak))
  return out


def logprob_memory(vocab=151_936, batch=4, seq=1024, hidden=64):
  """Compiled peak bytes (and forward seconds) of chunked vs naive."""
  cfg = TransformerConfig(
    vocab_size=vocab,
    hidden_size=hidden,
    intermediate_size=2 * hidden,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
  )
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  tokens = jnp.asarray(
    np.random.default_rng(2).integers(0, vocab, (batch, seq))
  )
  rows = {}
  for name, fn in (
    ('chunked', token_logprobs),
    ('naive', naive_token_logprobs),
  ):

    def fwd(state, tokens, fn=fn):
      return fn(nnx.merge(graphdef, state), tokens)

    def loss(state, tokens, fn=fn):
      return fwd(state, tokens, fn).mean()

    stats = {}
    for kind, f in (('fwd', fwd), ('fwd+bwd', jax.grad(loss))):
      compiled = jax.jit(f).lower(state, tokens).compile()
      mem = compiled.memory_analysis()
      stats[kind] = (
        mem.temp_size_in_bytes
        + mem.argument_size_in_bytes
        + mem.output_size_in_bytes
      )
      if kind == 'fwd':
        jax.block_until_ready(compiled(state, tokens))
        t = time.perf_counter()
        jax.block_until_ready(compiled(state, tokens))
        stats['fwd_s'] = time.perf_counter() - t
    rows[name] = stats
  return cfg, rows


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--batch', type=int, default=4)
  ap.add_argument('--seq', type=int, default=512)
  ap.add_argument('--steps', type=int, default=5)
  ap.add_argument('--dtype', default='float32')
  ap.add_argument('--skip-memory', action='store_true')
  args = ap.parse_args()

  cfg = BENCH_CONFIG.replace(param_dtype=args.dtype, dtype=args.dtype)
  print(
    f'backend: {jax.default_backend()} x{jax.device_count()}  '
    f'jax {jax.__version__}'
  )
  print(
    f'config: {cfg.num_params() / 1e6:.1f}M params, D={cfg.hidden_size} '
    f'L={cfg.num_layers} H={cfg.num_heads} K={cfg.num_kv_heads} '
    f'F={cfg.intermediate_size} V={cfg.vocab_size} (tied), {args.dtype}'
  )
  runs = train_throughput(cfg, args.batch, args.seq, args.steps)
  flops = args.batch * args.seq * model_flops_per_token(cfg, args.seq)
  secs = np.array([t for t, _ in runs])
  peaks = np.array([p for _, p in runs])
  fractions = flops / secs / peaks
  print(
    f'\n(a) fwd+bwd, batch {args.batch} x seq {args.seq}: '
    f'{args.batch * args.seq / np.median(secs):,.0f} tokens/s median '
    f'({np.median(secs) * 1e3:.0f} ms/step; best '
    f'{args.batch * args.seq / secs.min():,.0f} tokens/s), {args.steps} steps'
  )
  print(
    f'(b) model FLOPs {flops / 1e9:.0f} G/step; achieved '
    f'{np.median(flops / secs) / 1e9:.1f} GFLOP/s median; dense-matmul peak '
    f'(2048^3 {args.dtype}, best of 5 before each step) {np.median(peaks) / 1e9:.1f} '
    f'GFLOP/s median [{peaks.min() / 1e9:.0f}-{peaks.max() / 1e9:.0f}]'
  )
  print(
    f'    fraction of peak per step: median {np.median(fractions):.1%} '
    f'[{fractions.min():.1%}-{fractions.max():.1%}]'
  )
  if args.skip_memory:
    return
  mcfg, rows = logprob_memory()
  print(
    f'\n(c) token_logprobs memory, V={mcfg.vocab_size}, batch 4 x seq 1024, '
    f'D={mcfg.hidden_size}, 1 layer (chunk 128):'
  )
  print(f'    {"":8s} {"fwd peak":>10s} {"fwd+bwd peak":>13s} {"fwd time":>9s}')
  for name, s in rows.items():
    print(
      f'    {name:8s} {s["fwd"] / 2**20:8.0f}MB {s["fwd+bwd"] / 2**20:11.0f}MB '
      f'{s["fwd_s"]:8.2f}s'
    )
  c, n = rows['chunked'], rows['naive']
  print(
    f'    naive / chunked: fwd {n["fwd"] / c["fwd"]:.1f}x, '
    f'fwd+bwd {n["fwd+bwd"] / c["fwd+bwd"]:.1f}x'
  )


if __name__ == '__main__':
  main()
