"""Fused attention against the jnp reference (`model.attention`, issue 45
item 2): training forward + backward, side by side in one run.

  python bench/attention.py                        # jnp vs xla, CPU
  python bench/attention.py --impls=jnp,xla,cudnn --dtype=bfloat16   # GPU

Two workloads on SmolLM2-135M's layer shape (D 576, 9 query heads, 3 KV
heads, head dim 64, MLP 1536; `--layers` of them, random weights), packed
rows of `--rows` x `--length` tokens (sequences of 64..length/2 tokens
until the row is full, as the trainer packs):

  op     the attention call alone (q, k, v -> out, then the vjp of a random
         cotangent): what the implementation itself costs;
  model  the trunk's training forward + backward (hidden states -> a sum of
         squares, gradients of every parameter): what it changes in a step.

Repetitions alternate between the implementations (the same background
load); each line gives the median seconds [min-max] and the median paired
ratio to the first implementation (> 1: faster than it). The op part also
prints each implementation's largest difference to the first one (output
and q/k/v gradients): the equality check on a device the tests do not
reach (cuDNN).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcorr.model import Transformer, TransformerConfig
from jaxcorr.model import attention as fused
from jaxcorr.model.layers import attend

SMOLLM2_LAYER = dict(
  vocab_size=49152,
  hidden_size=576,
  intermediate_size=1536,
  num_heads=9,
  num_kv_heads=3,
  tie_embeddings=True,
)


def packed_segments(rows: int, length: int, seed: int = 0) -> np.ndarray:
  """[rows, length] ids: sequences of 64..length/2 tokens packed in order."""
  rng = np.random.default_rng(seed)
  out = np.zeros((rows, length), np.int32)
  for r in range(rows):
    pos, seg = 0, 1
    while pos < length:
      n = int(rng.integers(64, max(65, length // 2)))
      out[r, pos : pos + n] = seg
      pos, seg = pos + n, seg + 1
  return out


def op_step(impl: str, args, seg: jax.Array):
  """A jitted attention forward + vjp at the layer's shape."""
  c = SMOLLM2_LAYER
  dh = c['hidden_size'] // c['num_heads']
  keys = jax.random.split(jax.random.key(0), 4)
  shape = (args.rows, args.length)
  q = jax.random.normal(keys[0], (*shape, c['num_heads'], dh), args.dtype)
  k = jax.random.normal(keys[1], (*shape, c['num_kv_heads'], dh), args.dtype)
  v = jax.random.normal(keys[2], k.shape, args.dtype)
  ct = jax.random.normal(keys[3], q.shape, args.dtype)
  mask = fused.CausalSegments(seg, args.length)

  def run(q, k, v):
    if impl == 'jnp':
      fn = lambda q, k, v: attend(q, k, v, mask.dense())  # noqa: E731
    else:
      fn = lambda q, k, v: fused.self_attention(impl, q, k, v, seg)  # noqa: E731
    out, pull = jax.vjp(fn, q, k, v)
    return out, pull(ct)

  step = jax.jit(run)
  return lambda: jax.block_until_ready(step(q, k, v))


def model_step(impl: str, args, seg: jax.Array):
  """The trunk's jitted training forward + backward."""
  cfg = TransformerConfig(
    **SMOLLM2_LAYER,
    num_layers=args.layers,
    attention=impl,
    dtype=args.dtype,
  )
  graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  tokens = jax.random.randint(jax.random.key(1), seg.shape, 0, cfg.vocab_size)

  def loss(params):
    model = nnx.merge(graphdef, params)
    h, _ = model.hidden_states(tokens, segment_ids=seg)
    return jnp.sum(jnp.square(h.astype(jnp.float32)))

  step = jax.jit(jax.value_and_grad(loss))
  return lambda: jax.block_until_ready(step(params))


def timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--impls', default='jnp,xla')
  ap.add_argument('--parts', default='op,model')
  ap.add_argument('--rows', type=int, default=4)
  ap.add_argument('--length', type=int, default=512)
  ap.add_argument('--layers', type=int, default=2)
  ap.add_argument('--dtype', default='float32')
  ap.add_argument('--reps', type=int, default=5)
  args = ap.parse_args()
  impls = args.impls.split(',')
  seg = jnp.asarray(packed_segments(args.rows, args.length))
  print(
    f'backend: {jax.default_backend()} ({jax.devices()[0].device_kind}), '
    f'jax {jax.__version__}; {args.rows} rows x {args.length} tokens, '
    f'{int(seg.max())} max segments per row; {args.dtype}; '
    f'{args.reps} reps; SmolLM2 layer shape, {args.layers} layers'
  )
  med = statistics.median
  for part in args.parts.split(','):
    make = {'op': op_step, 'model': model_step}[part]
    steps = {i: make(i, args, seg) for i in impls}
    outs = {i: s() for i, s in steps.items()}  # compile
    if part == 'op':  # the device's equality check against the first
      print(f'\nop: largest |difference| to {impls[0]} (output, dq, dk, dv)')
      for i in impls[1:]:
        diffs = jax.tree.map(
          lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b))),
          jax.tree.leaves(outs[i]),
          jax.tree.leaves(outs[impls[0]]),
        )
        print(f'  {i:17s} ' + ' '.join(f'{d:.2e}' for d in diffs))
    times = {i: [] for i in impls}
    for _ in range(args.reps):
      for i, s in steps.items():
        times[i].append(timed(s))
    base = times[impls[0]]
    print(f'\n{part}: train forward + backward')
    for i, ts in times.items():
      pairs = [b / t for b, t in zip(base, ts)]
      print(
        f'  {i:17s} {med(ts):7.4f} s [{min(ts):.4f}-{max(ts):.4f}]  '
        f'{impls[0]} / {i}: {med(pairs):.2f}x '
        f'[{min(pairs):.2f}-{max(pairs):.2f}]'
      )


if __name__ == '__main__':
  main()
