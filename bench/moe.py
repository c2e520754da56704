"""MoE benchmark (issue: MoE policies with rollout routing replay).

Same-run ratios only (the machine is shared and noisy):

  (a) one MoE block, forward + backward: the grouped dispatch
      (`jax.lax.ragged_dot` over tokens sorted by expert) vs the dense
      all-experts reference (`moe_dispatch='dense'`);
  (b) a Mixtral policy (E experts of width F, top-k) vs a Llama policy of
      MLP width k x F (the same active FLOPs per token), forward +
      backward tokens/s (the same loss on the full logits);
  (c) the cost of recording routing in the engine: one cached decode
      forward returning the experts (`routed_hidden_states`, what the
      engine runs for an MoE policy) vs the same forward returning only
      the hidden states;
  (d) the cost of replay in the update: forward + backward with a
      replayed routing vs free routing.

Usage: python bench/moe.py [--tokens 2048] [--repeat 5]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcorr.model import Transformer, TransformerConfig
from jaxcorr.model.moe import dense_experts, grouped_experts, route


def best_time(fn, *args, repeat: int) -> float:
  jax.block_until_ready(fn(*args))  # compile
  times = []
  for _ in range(repeat):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return min(times)


def bench_dispatch(n: int, d: int, e: int, f: int, k: int, repeat: int):
  key = jax.random.split(jax.random.PRNGKey(0), 5)
  x = jax.random.normal(key[0], (n, d))
  router = jax.random.normal(key[1], (d, e)) * 0.3
  w = [
    jax.random.normal(key[2], (e, d, f)) * 0.05,
    jax.random.normal(key[3], (e, d, f)) * 0.05,
    jax.random.normal(key[4], (e, f, d)) * 0.05,
  ]

  def make(dispatch):
    def loss(x, router, w):
      experts, gates, _ = route(x @ router, k, True)
      return jnp.sum(jnp.tanh(dispatch(x, experts, gates, *w)))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

  g = best_time(make(grouped_experts), x, router, w, repeat=repeat)
  dn = best_time(make(dense_experts), x, router, w, repeat=repeat)
  return n / g, n / dn


def policy_configs(e: int, k: int, f: int):
  common = dict(
    vocab_size=512,
    hidden_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=1024,
  )
  moe = TransformerConfig(
    architecture='MixtralForCausalLM',
    intermediate_size=f,
    moe_intermediate_size=f,
    num_experts=e,
    num_experts_per_tok=k,
    **common,
  )
  dense = TransformerConfig(intermediate_size=k * f, **common)
  return moe, dense


def train_throughput(cfg, tokens, repeat, replay=None):
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))

  @jax.jit
  def grad(state, tokens, replay):
    def loss(state):
      m = nnx.merge(graphdef, state)
      h, _, _ = m.routed_hidden_states(tokens, replay=replay)
      return jnp.sum(jax.nn.log_softmax(m.logits(h)).max(-1))

    return jax.grad(loss)(state)

  t = best_time(grad, state, tokens, replay, repeat=repeat)
  return tokens.size / t


def decode_record_cost(cfg, rows, repeat):
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  cache = model.init_cache(rows, 256)
  cache = cache.replace(index=jnp.full((rows,), 100, jnp.int32))
  cache = cache.replace(segment_ids=None)
  tok = jnp.ones((rows, 1), jnp.int32)

  @jax.jit
  def plain(state, cache):
    m = nnx.merge(graphdef, state)
    h, c = m.hidden_states(tok, cache=cache, attend_len=128)
    return m.logits(h), c.k[0]

  @jax.jit
  def recorded(state, cache):
    m = nnx.merge(graphdef, state)
    h, c, stats = m.routed_hidden_states(tok, cache=cache, attend_len=128)
    return m.logits(h), c.k[0], stats.experts

  return (
    best_time(plain, state, cache, repeat=repeat),
    best_time(recorded, state, cache, repeat=repeat),
  )


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--tokens', type=int, default=2048)
  parser.add_argument('--repeat', type=int, default=5)
  args = parser.parse_args()
  e, k, f = 8, 2, 96
  print(f'device: {jax.devices()[0].device_kind}, E={e} k={k} F={f}')
  g, dn = bench_dispatch(args.tokens, 128, e, f, k, args.repeat)
  print(
    f'(a) MoE block fwd+bwd, {args.tokens} tokens: grouped {g:,.0f} tok/s, '
    f'dense reference {dn:,.0f} tok/s, grouped/dense {g / dn:.2f}x'
  )
  moe, dense = policy_configs(e, k, f)
  seq = 256
  tokens = jnp.asarray(
    np.random.default_rng(0).integers(0, 512, (args.tokens // seq, seq))
  )
  t_moe = train_throughput(moe, tokens, args.repeat)
  t_dense = train_throughput(dense, tokens, args.repeat)
  print(
    f'(b) policy fwd+bwd: MoE {t_moe:,.0f} tok/s, dense (MLP {k * f}) '
    f'{t_dense:,.0f} tok/s, MoE/dense {t_moe / t_dense:.2f}x'
  )
  plain, recorded = decode_record_cost(moe, 64, args.repeat * 4)
  print(
    f'(c) decode step, 64 rows: without routing {plain * 1e3:.2f} ms, '
    f'recording it {recorded * 1e3:.2f} ms, +{recorded / plain - 1:.1%}'
  )
  model = Transformer(moe, rngs=nnx.Rngs(0))
  replay = nnx.jit(lambda m, t: m.routed_hidden_states(t)[2].experts)(
    model, tokens
  )
  free = train_throughput(moe, tokens, args.repeat)
  replayed = train_throughput(moe, tokens, args.repeat, replay=replay)
  print(
    f'(d) update fwd+bwd: free routing {free:,.0f} tok/s, replayed '
    f'{replayed:,.0f} tok/s, slowdown {free / replayed - 1:+.1%}'
  )


if __name__ == '__main__':
  main()
