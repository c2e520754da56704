"""Speculative decoding's speed (issue 42 item 4): `driver.generate`
tokens/s and mean acceptance length with `speculative` off, 'ngram' and
'layers', at several batch sizes, alternating repetitions so every side
sees the same background load.

  python bench/speculative.py                     # batch 1, 8, 32; 3 reps
  python bench/speculative.py --batches=1,8 --reps=5 --k=4 --new=64

Model: bench/rollout.py's 5M-param float32 model (random weights, seed 0),
prompts of 16 ids that repeat a 4-gram (what prompt lookup feeds on), no
stop tokens. Two samplings: greedy (top_k=1) and temperature 1.0.

Acceptance length: tokens emitted per verify forward per row, Σ counts /
Σ (rounds x rows active when the chunk started), a lower bound at batch >
1 (rows that finish mid-chunk count for every round). 1.0 for 'off'.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import rollout as bench  # bench/rollout.py: the model

from jaxcorr.rollout import driver
from jaxcorr.rollout.engine import PolicyEngine
from jaxcorr.rollout.speculative import SpeculativeConfig

SAMPLINGS = {'greedy': dict(top_k=1), 'tau1': dict(temperature=1.0)}


class Side:
  """One engine (draft kind) at one batch size, counting its rounds."""

  def __init__(self, model, draft, batch, args):
    spec = None if draft == 'off' else SpeculativeConfig(draft=draft, k=args.k)
    self.draft, self.batch, self.new = draft, batch, args.new
    self.engine = PolicyEngine(
      model,
      max_concurrent_decodes=batch,
      max_prefill_length=16,
      max_target_length=16 + args.new,
      decode_chunk=16,
      speculative=spec,
    )
    self.rounds = self.tokens = 0
    inner = self.engine.batched.decode_chunk

    def counted(state, *a, **kw):
      n_active = int(jax.device_get(state.active).sum())  # before donation
      state, out = inner(state, *a, **kw)
      self.rounds += int(out.steps) * n_active
      self.tokens += int(jax.device_get(out.counts).sum())
      return state, out

    self.engine.batched.decode_chunk = counted
    for name in SAMPLINGS:  # compile outside the timings
      self.run(name, seed=100)

  def run(self, sampling: str, seed: int) -> dict:
    self.rounds = self.tokens = 0
    prompts = [
      [(i + j) % 7 + 3 for j in (0, 1, 2, 3)] * 4 for i in range(self.batch)
    ]
    t0 = time.perf_counter()
    out = driver.generate(
      self.engine, prompts, max_new_tokens=self.new, seed=seed,
      **SAMPLINGS[sampling],
    )  # fmt: skip
    secs = time.perf_counter() - t0
    return dict(
      tps=int(out.response_mask.sum()) / secs,
      accept=self.tokens / max(self.rounds, 1),
    )


def main(argv=None) -> None:
  p = argparse.ArgumentParser()
  p.add_argument('--batches', default='1,8,32')
  p.add_argument('--drafts', default='off,ngram,layers')
  p.add_argument('--reps', type=int, default=3)
  p.add_argument('--k', type=int, default=4)
  p.add_argument('--new', type=int, default=64)
  args = p.parse_args(argv)
  model = bench.bench_model()
  drafts = args.drafts.split(',')
  print(f'device: {jax.devices()[0].device_kind}, k={args.k}, new={args.new}')
  print('batch sampling draft    tok/s  ratio  accept_len')
  for batch in map(int, args.batches.split(',')):
    sides = [Side(model, d, batch, args) for d in drafts]
    for sampling in SAMPLINGS:
      res = {d: [] for d in drafts}
      for rep in range(args.reps):  # alternate: same load for every side
        for side in sides:
          res[side.draft].append(side.run(sampling, seed=rep))
      base = res[drafts[0]]
      for d in drafts:
        ratios = [r['tps'] / b['tps'] for r, b in zip(res[d], base)]
        print(
          f'{batch:5d} {sampling:8s} {d:7s} '
          f'{statistics.median(r["tps"] for r in res[d]):7.1f} '
          f'{statistics.median(ratios):6.2f} '
          f'{statistics.median(r["accept"] for r in res[d]):6.2f}',
          flush=True,
        )


if __name__ == '__main__':
  sys.exit(main())
