"""Where a decode step's time goes: a `jax.profiler` trace of the engine's
`decode_chunk` at `bench/rollout.py`'s shapes, each XLA:CPU op's time
summed over threads and grouped by the source of its HLO op (the
`op_name` metadata of the compiled chunk). Shares, not absolute times,
are the figures to read on a shared machine (docs/rollout.md, "Where a
decode step's time goes").

Usage: python bench/decode_profile.py [--rows 64] [--attend 160]
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import tempfile

import jax
import jax.numpy as jnp
import rollout as bench  # bench/rollout.py: the model and shapes
from flax import nnx

from jaxcorr.model import Transformer, TransformerConfig
from jaxcorr.rollout.engine import PolicyEngine

GROUPS = (  # (substring of the op's source, group), first match wins
  ('bkgst,bktd', 'attention p.v dots'),
  ('bskgd,bktd', 'attention q.k dots'),
  ('bsd,df', 'MLP matmuls'),
  ('bsf,fd', 'MLP matmuls'),
  ('bsd,dhk', 'q/k/v projections'),
  ('bshk,hkd', 'o projection'),
  ('_uniform', 'sampling: random bits'),
  ('_threefry', 'sampling: random bits'),
)


def group(shape: str, source: str, vocab: int) -> str:
  for key, name in GROUPS:
    if key in source:
      return name
  if f',{vocab}]' in shape or 'log_softmax' in source:
    return 'LM head + vocabulary-wide passes'
  return 'other: ' + source.split('/')[-1]


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument('--rows', type=int, default=64)
  ap.add_argument('--attend', type=int, default=bench.PROMPT_LEN + bench.NEW)
  ap.add_argument('--chunks', type=int, default=3)
  args = ap.parse_args()
  n, steps = args.rows, 32
  model = Transformer(TransformerConfig(**bench.MODEL), rngs=nnx.Rngs(0))
  engine = PolicyEngine(
    model,
    max_concurrent_decodes=n,
    max_prefill_length=bench.PROMPT_LEN,
    max_target_length=bench.PROMPT_LEN + bench.NEW,
    decode_chunk=steps,
  )
  stop = engine.stop_array([])

  def fresh():  # every row live from position 20, never stopping
    s = engine.init_decode_state()
    return s.replace(
      active=jnp.ones((n,), bool),
      limit=jnp.full((n,), 10**6, jnp.int32),
      cache=s.cache.replace(index=jnp.full((n,), 20, jnp.int32)),
    )

  jax.block_until_ready(
    engine.decode_chunk(fresh(), stop, attend_len=args.attend)
  )
  hlo = engine.programs.chunk.lower(
    engine.params, fresh(), stop, jnp.int32(0), num_steps=steps,
    attend_len=args.attend,
  ).compile().as_text()  # fmt: skip
  meta = {}
  for line in hlo.splitlines():
    m = re.match(r'\s*(?:ROOT )?%(\S+) = (\S+) .*?op_name="([^"]+)"', line)
    if m:
      meta.setdefault(m.group(1), (m.group(2), m.group(3)))
  states = [fresh() for _ in range(args.chunks)]
  jax.block_until_ready(states)
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    for s in states:
      jax.block_until_ready(
        engine.decode_chunk(s, stop, attend_len=args.attend)
      )
    jax.profiler.stop_trace()
    data = jax.profiler.ProfileData.from_file(
      glob.glob(f'{d}/**/*.xplane.pb', recursive=True)[0]
    )
  total = collections.Counter()
  for plane in data.planes:
    for line in plane.lines:
      if not line.name.startswith('tf_XLAEigen'):
        continue
      for ev in line.events:
        if ev.name in meta:
          total[group(*meta[ev.name], bench.MODEL['vocab_size'])] += (
            ev.duration_ns
          )
  all_ns = sum(total.values())
  per_step = 1e-6 / (args.chunks * steps)
  print(
    f'{n} rows, attention bucket {args.attend}: op time {all_ns * per_step:.2f} ms/step'
  )
  for name, ns in total.most_common(12):
    print(f'  {100 * ns / all_ns:5.1f}%  {ns * per_step:7.3f} ms  {name}')


if __name__ == '__main__':
  main()
