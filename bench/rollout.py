"""Rollout benchmark (issue 5: the JetStream rollout engine).

Measures, in one run (the machine is shared and noisy, so only numbers taken
in the same run are compared):

  (a) decode throughput (tokens/s) of `PolicyEngine.generate` with every
      slot busy: `--slots` slots, `--new-tokens` steps after prefill;
  (b) the same tokens from a naive loop that recomputes the full forward
      over [slots, prompt + generated] every step (the no-KV-cache
      baseline; padded to one length so it compiles once): ratio (a)/(b);
  (c) the bandwidth bound: each decode step must read the params and the
      whole KV cache once; with the memory bandwidth measured here (a
      jitted reduction over a large array), bound = slots / (bytes / BW)
      tokens/s, and (a) is reported as a fraction of it.

Usage: python bench/rollout.py [--slots 64] [--new-tokens 256]
       [--prompt 32] [--dtype float32]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcorr.model import Transformer, TransformerConfig
from jaxcorr.rollout.engine import PolicyEngine, SamplingParams

SMALL = TransformerConfig(
  architecture='LlamaForCausalLM',
  vocab_size=4096,
  hidden_size=256,
  intermediate_size=768,
  num_layers=4,
  num_heads=8,
  num_kv_heads=4,
)


def _bandwidth() -> float:
  """Bytes/s of a jitted sum over a 256 MiB float32 array (best of 5)."""
  x = jnp.ones((64 * 1024 * 1024,), jnp.float32)
  f = jax.jit(jnp.sum)
  f(x).block_until_ready()
  best = min(_timed(lambda: f(x).block_until_ready()) for _ in range(5))
  return x.nbytes / best


def _timed(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument('--slots', type=int, default=64)
  ap.add_argument('--new-tokens', type=int, default=256)
  ap.add_argument('--prompt', type=int, default=32)
  ap.add_argument('--naive-steps', type=int, default=16)
  ap.add_argument('--dtype', default='float32')
  args = ap.parse_args()
  n, steps, p = args.slots, args.new_tokens, args.prompt
  model = Transformer(SMALL, rngs=nnx.Rngs(0))
  total = p + steps + 1
  engine = PolicyEngine(
    model,
    max_concurrent_decodes=n,
    max_prefill_length=p,
    max_target_length=total,
    dtype=jnp.dtype(args.dtype),
  )
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, SMALL.vocab_size, (n, p))
  state = engine.init_decode_state()
  sp = SamplingParams(temperature=1.0)
  for slot in range(n):
    padded, length = engine.pad_prompt(prompts[slot])
    prefix = engine.prefill(
      params=engine.params,
      padded_tokens=padded,
      true_length=length,
      sampling_params=sp,
      key=jax.random.PRNGKey(slot),
    )
    state = engine.insert(prefix, state, slot)
  state, res = engine.generate(engine.params, state)  # compile
  res.data.block_until_ready()

  def decode():
    nonlocal state
    for _ in range(steps - 1):
      state, out = engine.generate(engine.params, state)
    out.data.block_until_ready()

  engine_s = _timed(decode) / (steps - 1)
  engine_tps = n / engine_s

  # (b) naive: full forward over the whole padded sequence every step.
  @nnx.jit
  def naive_step(model, tokens, length):
    logits = model(tokens)
    nxt = jnp.argmax(
      jax.lax.dynamic_index_in_dim(logits, length - 1, 1, False), -1
    )
    return jax.lax.dynamic_update_index_in_dim(
      tokens, nxt.astype(jnp.int32), length, 1
    )

  tokens = jnp.zeros((n, total), jnp.int32).at[:, :p].set(prompts)
  tokens = naive_step(model, tokens, jnp.int32(p))
  tokens.block_until_ready()

  def naive():
    nonlocal tokens
    for i in range(args.naive_steps):
      tokens = naive_step(model, tokens, jnp.int32(p + 1 + i))
    tokens.block_until_ready()

  naive_tps = n / (_timed(naive) / args.naive_steps)

  # (c) bandwidth bound.
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.params))
  kv_bytes = state.cache.k.nbytes + state.cache.v.nbytes
  bw = _bandwidth()
  bound_tps = n / ((param_bytes + kv_bytes) / bw)
  print(f'device: {jax.devices()[0].device_kind}, dtype {args.dtype}')
  print(f'slots {n}, prompt {p}, new tokens {steps}, cache {total}')
  print(
    f'params {param_bytes / 2**20:.1f} MiB, KV cache {kv_bytes / 2**20:.1f} MiB'
  )
  print(
    f'(a) engine decode      {engine_tps:10.0f} tok/s ({engine_s * 1e3:.2f} ms/step)'
  )
  print(
    f'(b) naive full forward {naive_tps:10.0f} tok/s  ratio a/b = {engine_tps / naive_tps:.1f}x'
  )
  print(
    f'(c) bandwidth bound    {bound_tps:10.0f} tok/s at {bw / 1e9:.1f} GB/s  fraction a/c = {engine_tps / bound_tps:.2f}'
  )


if __name__ == '__main__':
  main()
