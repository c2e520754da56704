"""Speculative decoding's speed (issue 42 item 4): `driver.generate`
tokens/s and mean acceptance length with `speculative` off, 'ngram',
'layers' and 'model', at several batch sizes, alternating repetitions so
every side sees the same background load; then the fixed checkpoint
draft's acceptance as the policy moves away from it.

  python bench/speculative.py                     # batch 1, 8, 32, 128
  python bench/speculative.py --batches=1,8 --reps=5 --k=4 --new=64
  python bench/speculative.py --draft_model=WORKDIR  # a saved draft

Model: bench/rollout.py's 5M-param float32 model (random weights, seed 0),
prompts of 16 ids that repeat a 4-gram (what prompt lookup feeds on), no
stop tokens. Two samplings: greedy (top_k=1) and temperature 1.0.

The 'model' draft: --draft_model (an HF directory, a jaxcorr workdir or
workdir@STEP, loaded by the trainer's loader) or, by default, a separate
1-layer model cut from the policy (its first layer, final norm and head
copied): the proposals of 'layers' with draft_layers=1, but its own model
and KV cache, as a distilled draft checkpoint has.

Drift (--drift): the draft is a copy of the policy at "step 0", fixed;
the policy moves by `engine.update_params` (the weight sync) to
w + σ·std(w)·N(0, 1) per tensor, and the acceptance length at batch 8 is
measured for each σ.

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
import numpy as np
import rollout as bench  # bench/rollout.py: the model
from flax import nnx

from jaxcorr.model import Transformer
from jaxcorr.rollout import driver
from jaxcorr.rollout.draft_model import DraftModel
from jaxcorr.rollout.engine import PolicyEngine
from jaxcorr.rollout.speculative_config import SpeculativeConfig
from jaxcorr.train.checkpoints import model_source

SAMPLINGS = {'greedy': dict(top_k=1), 'tau1': dict(temperature=1.0)}


class Side:
  """One engine (draft kind) at one batch size, counting its rounds."""

  def __init__(self, model, draft, batch, args, draft_model=None):
    spec = None
    if draft != 'off':
      path = 'checkpoint' if draft == 'model' else ''
      spec = SpeculativeConfig(draft=draft, k=args.k, draft_model=path)
    self.draft, self.batch, self.new = draft, batch, args.new
    self.engine = PolicyEngine(
      model,
      max_concurrent_decodes=batch,
      max_prefill_length=16,
      max_target_length=16 + args.new,
      decode_chunk=16,
      speculative=spec,
      draft=draft_model if draft == 'model' else None,
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


def first_layer_draft(model) -> DraftModel:
  """A separate 1-layer model holding the policy's first layer, final
  norm and head (the default checkpoint draft)."""
  cfg = model.config.replace(num_layers=1)
  small = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, shapes = nnx.split(small)
  full = dict(nnx.to_flat_state(nnx.state(model)))
  # Every path of the 1-layer model is one of the full model's.
  state = nnx.from_flat_state(
    [(path, full[path]) for path, _ in nnx.to_flat_state(shapes)]
  )
  return DraftModel(graphdef, cfg, state)


def load_draft(path: str, dtype: str) -> DraftModel:
  """--draft_model through the trainer's loader (model_source)."""
  src = model_source.resolve(path, '--draft_model')
  cfg = model_source.model_config(src, dtype)
  graphdef, params = model_source.load_params(src, cfg, None)
  return DraftModel(graphdef, cfg, params)


def moved(params, sigma: float, seed: int = 0):
  """params + σ·std(w)·N(0, 1) per tensor (a policy after training)."""
  leaves, tree = jax.tree.flatten(params)
  rng = np.random.default_rng(seed)
  out = [
    w + sigma * float(np.std(w)) * rng.standard_normal(w.shape, np.float32)
    for w in map(np.asarray, leaves)
  ]
  return jax.tree.unflatten(tree, out)


def drift(model, args) -> None:
  """A fixed draft (the policy at step 0) while the policy moves."""
  side = Side(model, 'model', 8, args, DraftModel.of(model))
  params = nnx.state(model)
  print('sigma sampling accept_len  tok/s   (batch 8, fixed draft)')
  for sigma in map(float, args.drift.split(',')):
    side.engine.update_params(moved(params, sigma))
    for sampling in SAMPLINGS:
      res = [side.run(sampling, seed=rep) for rep in range(args.reps)]
      print(
        f'{sigma:5.2f} {sampling:8s} '
        f'{statistics.median(r["accept"] for r in res):6.2f} '
        f'{statistics.median(r["tps"] for r in res):9.1f}',
        flush=True,
      )


def main(argv=None) -> None:
  p = argparse.ArgumentParser()
  p.add_argument('--batches', default='1,8,32,128')
  p.add_argument('--drafts', default='off,ngram,layers,model')
  p.add_argument('--reps', type=int, default=3)
  p.add_argument('--k', type=int, default=4)
  p.add_argument('--new', type=int, default=64)
  p.add_argument('--draft_model', default='', help="'': the 1-layer cut")
  p.add_argument('--drift', default='0,0.03,0.1,0.3', help="'': skip")
  args = p.parse_args(argv)
  model = bench.bench_model()
  drafts = args.drafts.split(',')
  small = (
    load_draft(args.draft_model, 'float32')
    if args.draft_model
    else first_layer_draft(model)
  )
  print(f'device: {jax.devices()[0].device_kind}, k={args.k}, new={args.new}')
  print('batch sampling draft    tok/s  ratio  accept_len')
  for batch in map(int, args.batches.split(',')):
    sides = [Side(model, d, batch, args, small) for d in drafts]
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
  if args.drift:
    drift(model, args)


if __name__ == '__main__':
  sys.exit(main())
