"""MoE benchmark (issue: MoE policies with rollout routing replay).

Same-run ratios only (the machine is shared and noisy):

  (a) one MoE block, forward + backward: the grouped dispatch
      (`jax.lax.ragged_dot` over tokens sorted by expert) vs the dense
      all-experts reference (`moe_dispatch='dense'`);
  (b) a Mixtral policy (E experts of width F, top-k) vs a Llama policy of
      MLP width k x F (the same active FLOPs per token), forward +
      backward tokens/s (the same loss on the full logits);
  (c) the cost of recording routing in the engine: one engine decode
      chunk (`jaxcorr.rollout.decode.decode_chunk`, what the engine runs)
      of an MoE policy as it is (returning `Chunk.routing`) vs the same
      program with the routing dropped from its outputs (XLA then removes
      the routing buffer from the loop: the same chunk without recording);
  (d) the cost of replay in the update: forward + backward with a
      replayed routing vs free routing.

Each pair is timed interleaved (A B B A ...; a call of each per round, the
order alternating), and the figure is the median over rounds of the
round's B / A ratio with its interquartile range: a shared machine's
load drifts over seconds, which best-of-n of A then best-of-n of B turns
into a spurious ratio. For (c) and (d) the script also compares the two
compiled programs (XLA's cost analysis: flops and bytes accessed, and the
count of sort / gather / scatter / while instructions), which no load
changes.

Usage: python bench/moe.py [--tokens 2048] [--rounds 21]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcorr.model import Transformer, TransformerConfig
from jaxcorr.model.moe import dense_experts, grouped_experts, route
from jaxcorr.rollout import decode


def _once(fn, args) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0


def paired(fa, args_a, fb, args_b, rounds: int) -> dict:
  """Interleaved timing of A and B: per round one call of each, the order
  alternating; median B / A over rounds, its quartiles, median times."""
  jax.block_until_ready(fa(*args_a))  # compile
  jax.block_until_ready(fb(*args_b))
  ta, tb = [], []
  for r in range(rounds):
    if r % 2:
      tb.append(_once(fb, args_b))
      ta.append(_once(fa, args_a))
    else:
      ta.append(_once(fa, args_a))
      tb.append(_once(fb, args_b))
  ratio = np.asarray(tb) / np.asarray(ta)
  q1, med, q3 = np.percentile(ratio, [25, 50, 75])
  return dict(
    a=float(np.median(ta)), b=float(np.median(tb)), ratio=med, q1=q1, q3=q3
  )


def fmt_ratio(p: dict) -> str:
  return f'{p["ratio"]:.3f} (IQR {p["q1"]:.3f}-{p["q3"]:.3f})'


HLO_OPS = ('sort', 'gather', 'scatter', 'while', 'dynamic-update-slice')


def program_cost(fn, *args) -> dict:
  """Flops, bytes accessed and a few instruction counts of the compiled
  program (after XLA's optimisations)."""
  compiled = fn.lower(*args).compile()
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  text = compiled.as_text()
  out = {
    'flops': float(cost.get('flops', 0.0)),
    'bytes': float(cost.get('bytes accessed', 0.0)),
  }
  for op in HLO_OPS:
    out[op] = sum(
      f' {op}(' in line for line in text.splitlines() if ' = ' in line
    )
  return out


def fmt_cost(a: dict, b: dict) -> str:
  parts = [
    f'flops {b["flops"] / max(a["flops"], 1):.4f}x',
    f'bytes {b["bytes"] / max(a["bytes"], 1):.4f}x',
  ]
  parts += [f'{op} {a[op]}->{b[op]}' for op in HLO_OPS if a[op] or b[op]]
  return ', '.join(parts)


def bench_dispatch(n: int, d: int, e: int, f: int, k: int, rounds: int):
  """(a): the dense reference (A) vs the grouped dispatch (B)."""
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

  args = (x, router, w)
  return paired(make(dense_experts), args, make(grouped_experts), args, rounds)


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


def train_grad(cfg):
  """(jitted grad of a full-logits loss, params): routed forward +
  backward, `replay` [B, S, L_moe, k] or None."""
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))

  @jax.jit
  def grad(state, tokens, replay):
    def loss(state):
      m = nnx.merge(graphdef, state)
      h, _, _ = m.routed_hidden_states(tokens, replay=replay)
      return jnp.sum(jax.nn.log_softmax(m.logits(h)).max(-1))

    return jax.grad(loss)(state)

  return grad, state


def replay_cost(cfg, tokens, rounds):
  """(d): free routing (A) vs replaying the routing the same params pick
  (B: same experts, so the same dispatch work)."""
  grad, state = train_grad(cfg)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  replay = nnx.jit(lambda m, t: m.routed_hidden_states(t)[2].experts)(
    model, tokens
  )
  a, b = (state, tokens, None), (state, tokens, replay)
  cost = (program_cost(grad, *a), program_cost(grad, *b))
  return paired(grad, a, grad, b, rounds), cost


def decode_record_cost(cfg, rows, steps, rounds):
  """(c): an engine decode chunk of `steps` steps, `rows` slots at
  position 100 (attending to 128), without (A) and with (B) routing."""
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  sp_row = jnp.asarray([1.0, 0.0, 1.0, 0.0], jnp.float32)  # plain sampling
  state = decode.init_state(cfg, rows, 256, sp_row)
  state = state.replace(
    cache=state.cache.replace(index=jnp.full((rows,), 100, jnp.int32)),
    tokens=jnp.ones((rows,), jnp.int32),
    keys=jax.vmap(jax.random.PRNGKey)(jnp.arange(rows)),
    limit=jnp.full((rows,), 10**6, jnp.int32),
    active=jnp.ones((rows,), bool),
  )
  stop_ids = jnp.full((1,), -1, jnp.int32)  # no stop token: every step runs
  run = functools.partial(
    decode.decode_chunk, graphdef, num_steps=steps, attend_len=128
  )

  @jax.jit
  def recorded(params, state):
    return run(params, state, stop_ids, 0)

  @jax.jit
  def unrecorded(params, state):
    state, chunk = run(params, state, stop_ids, 0)
    return state, chunk.replace(routing=None)

  args = (params, state)
  cost = (program_cost(unrecorded, *args), program_cost(recorded, *args))
  return paired(unrecorded, args, recorded, args, rounds), cost


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--tokens', type=int, default=2048)
  parser.add_argument('--rounds', type=int, default=21)
  parser.add_argument('--decode-steps', type=int, default=32)
  args = parser.parse_args()
  e, k, f = 8, 2, 96
  n, r = args.tokens, args.rounds
  print(f'device: {jax.devices()[0].device_kind}, E={e} k={k} F={f}')
  print(f'figures: median of {r} interleaved rounds of B/A time (IQR)')
  p = bench_dispatch(n, 128, e, f, k, r)
  print(
    f'(a) MoE block fwd+bwd, {n} tokens: dense reference {n / p["a"]:,.0f} '
    f'tok/s, grouped {n / p["b"]:,.0f} tok/s; grouped/dense time '
    + fmt_ratio(p)
  )
  moe, dense = policy_configs(e, k, f)
  seq = 256
  tokens = jnp.asarray(
    np.random.default_rng(0).integers(0, 512, (n // seq, seq))
  )
  (g_dense, s_dense), (g_moe, s_moe) = train_grad(dense), train_grad(moe)
  p = paired(g_dense, (s_dense, tokens, None), g_moe, (s_moe, tokens, None), r)
  print(
    f'(b) policy fwd+bwd: dense (MLP {k * f}) {n / p["a"]:,.0f} tok/s, MoE '
    f'{n / p["b"]:,.0f} tok/s; MoE/dense time ' + fmt_ratio(p)
  )
  rows, steps = 64, args.decode_steps
  p, (ca, cb) = decode_record_cost(moe, rows, steps, r)
  print(
    f'(c) decode chunk, {rows} rows x {steps} steps: without routing '
    f'{p["a"] * 1e3:.1f} ms, recording it {p["b"] * 1e3:.1f} ms; '
    f'recorded/unrecorded time {fmt_ratio(p)}; programs: {fmt_cost(ca, cb)}'
  )
  p, (ca, cb) = replay_cost(moe, tokens, r)
  print(
    f'(d) update fwd+bwd: free routing {n / p["a"]:,.0f} tok/s, replayed '
    f'{n / p["b"]:,.0f} tok/s; replayed/free time {fmt_ratio(p)}; '
    f'programs: {fmt_cost(ca, cb)}'
  )


if __name__ == '__main__':
  main()
