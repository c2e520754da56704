"""The update step alone: packed vs padded rows, its split, FLOP utilisation.

  python bench/update.py                    # ~5 minutes on a 2-core CPU
  python bench/update.py --reps=5 --preset=bypass_pg_is --full-length
  python bench/update.py --like=DIR --new-tokens=512   # a real model's shape
  python bench/update.py --like=DIR --remat=none,dots  # two remat policies
  python bench/update.py --like=DIR --dtype=float32,bfloat16  # compute dtypes

`Steps.prepare` + `Steps.update` (jaxcorr/train/step.py) on one synthetic GRPO
batch: 16 prompts x 4 samples, 32-token prompts, responses of up to 128
tokens whose lengths spread from 10% to 100% of the cap (the engine's
realistic-length workload, bench/rollout.py; `--full-length`: every row at
the cap), the 5M Llama-style model of bench/rollout.py, computing in
`model.dtype` ('auto': float32 on CPU, bfloat16 over float32 weights on
GPU / TPU; `--dtype` sets it, `--dtype=float32,bfloat16` compares). The same
batch runs padded (`train.packing=False`) and packed (`True`), alternating
warm repetitions; the report gives each side's median and range, the
per-repetition paired ratio, the prepare/update split and the FLOP rate of
the tokens each side computes (padding included) over a dense-matmul peak
measured before each repetition, and over the rate the step's own matmuls
reach alone at their shapes (`gemm_ceiling`: what a step could reach if
everything but its matmuls took no time). Train tokens/s counts real tokens only
(prompt + response), so it is comparable across the two layouts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import rollout as bench  # bench/rollout.py: the model and workload shapes
from flax import nnx
from train import best_time, flops_per_token, matmul_peak  # bench/train.py

from configs import arith_tiny
from jaxcorr.losses import rewards
from jaxcorr.model import Transformer, TransformerConfig
from jaxcorr.model.logprobs import chunk_length
from jaxcorr.train import batch as batch_lib
from jaxcorr.train import build
from jaxcorr.train.batch import TrainBatch
from jaxcorr.train.packing import forward, layout
from jaxcorr.train.policy import transformer_config
from jaxcorr.train.state import TrainState, make_optimizer
from jaxcorr.train.step import Steps


def run_config(
  args, packing: bool, remat: str | None = None, sets: dict | None = None
):
  """The bench's run: arith_tiny with `args`' shapes, then `sets`
  ({'section.field': value}, e.g. {'rollout.exact': True})."""
  c = arith_tiny.get_config(args.preset)
  if args.like:  # a real model's shape, random weights (Side's init)
    c.model.hf_path = args.like
    # One layer compiled, not L: unrolled, SmolLM2's 30 layers did not
    # finish compiling four programs in 130 s on the H200.
    c.model.scan_layers = True
    c.model.remat = 'dots'  # as configs/smollm2_arith.py
  else:
    for k, v in bench.MODEL.items():
      if k != 'architecture':
        c.model[k] = v
    c.model.max_position_embeddings = bench.PROMPT_LEN + args.new_tokens
  c.rollout.max_prompt_length = bench.PROMPT_LEN
  c.rollout.max_new_tokens = args.new_tokens
  c.rollout.prompts_per_step = args.prompts
  c.rollout.samples_per_prompt = bench.SAMPLES
  c.train.mini_batches = args.mini_batches
  c.train.micro_batches = args.micro_batches
  c.train.shuffle_minibatches = False
  c.train.packing = packing
  if remat:
    c.model.remat = remat
  for path, value in (sets or {}).items():
    section, field = path.split('.')
    c[section][field] = value
  return build.build(c)


def vocab_size(like: str) -> int:
  """The vocabulary of `--like`'s model, else of the bench model."""
  if like:
    return TransformerConfig.from_hf_config(like).vocab_size
  return bench.MODEL['vocab_size']


def synthetic_batch(
  full_length: bool,
  *,
  prompts: int = bench.PROMPTS,
  new_tokens: int = bench.NEW,
  vocab: int = bench.MODEL['vocab_size'],
  seed: int = 0,
) -> TrainBatch:
  """The realistic-length GRPO batch (module docstring), numpy."""
  r = bench.train_rows(
    full_length,
    seed,
    rows=prompts * bench.SAMPLES,
    new=new_tokens,
    vocab=vocab,
  )
  b = r['tokens'].shape[0]
  return TrainBatch(
    tokens=r['tokens'],
    segment_ids=r['real'].astype(np.int32),
    response_mask=r['mask'],
    rollout_logp=r['logp'],
    temperature=np.ones(b, np.float32),
    top_k=np.zeros(b, np.int32),
    top_p=np.ones(b, np.float32),
    min_p=np.zeros(b, np.float32),
    group_ids=np.repeat(np.arange(prompts), bench.SAMPLES).astype(np.int32),
    seq_reward=r['reward'],
    version_gap=np.zeros(r['mask'].shape, np.int32),
  )


class Side:
  """One layout's compiled prepare + update on its own state."""

  def __init__(
    self,
    args,
    packing: bool,
    host: TrainBatch,
    remat: str | None = None,
    sets: dict | None = None,
  ):
    self.run = run_config(args, packing, remat, sets)
    self.mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ('data',))
    cfg = transformer_config(self.run.model)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    tx, schedule = make_optimizer(self.run.optim, 1e-5, 1000)
    state = TrainState(
      params=params,
      opt_state=jax.jit(tx.init)(params),
      kl_ctrl=rewards.KLControllerState(coef=jnp.zeros(())),
      rng=jax.random.PRNGKey(0),
      updates=jnp.zeros((), jnp.int32),
    )
    # Committed to the mesh, as the state a step returns is: otherwise the
    # second step compiles again (other input shardings) inside a timed
    # repetition.
    self.state = jax.device_put(
      state, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    )
    self.steps = Steps(self.run, graphdef, tx, schedule)
    self.host = host
    t = self.run.train
    self.packed = None
    self.computed = host.tokens.size  # positions the model runs on
    if packing:
      self.packed = layout.pack(
        host, mini_batches=t.mini_batches, micro_batches=t.micro_batches
      )
      self.computed = self.packed.tokens.size
    self.cfg = cfg

  def step(self) -> dict:
    """One prepare + update, host packing included; its times."""
    t0 = time.perf_counter()
    with jax.set_mesh(self.mesh):
      packed = None
      if self.packed is not None:
        t = self.run.train
        host_packed = layout.pack(
          self.host,
          mini_batches=t.mini_batches,
          micro_batches=t.micro_batches,
        )
        packed = forward.to_device(self.mesh, host_packed)
      dev = batch_lib.to_device(self.mesh, self.host)
      t1 = time.perf_counter()
      _, prepared, _ = self.steps.prepare(
        self.state.params, None, self.state.kl_ctrl, None, dev, packed
      )
      jax.block_until_ready(prepared)
      t2 = time.perf_counter()
      self.state, met = self.steps.update(self.state, prepared, packed)
      jax.block_until_ready((self.state, met))
      t3 = time.perf_counter()
    return dict(host=t1 - t0, prepare=t2 - t1, update=t3 - t2, total=t3 - t0)


def gemm_ceiling(cfg, positions: int, head_positions: int) -> float:
  """The FLOP rate the update's matmuls reach on their own: every dense
  product of a layer (q, k, v, o, gate, up, down) and the log-prob head,
  forward and both backward products (`dy @ Wᵀ`, and `xᵀ @ dy` as
  jaxcorr/model/projection.py computes it), each timed alone at its real
  shape, weighted by its FLOPs. A step cannot beat it: attention, norms,
  softmax and the optimizer only add time.

  Args:
    cfg: the model's TransformerConfig (dense layers).
    positions: the rows x length of one micro-batch (the layers' M).
    head_positions: the positions of one log-prob head chunk (its M).
  """
  d, dh = cfg.hidden_size, cfg.head_dim
  shapes = [  # (M, in, out, products per token)
    (positions, d, cfg.num_heads * dh, cfg.num_layers),  # q
    (positions, d, cfg.num_kv_heads * dh, 2 * cfg.num_layers),  # k, v
    (positions, cfg.num_heads * dh, d, cfg.num_layers),  # o
    (positions, d, cfg.intermediate_size, 2 * cfg.num_layers),  # gate, up
    (positions, cfg.intermediate_size, d, cfg.num_layers),  # down
    (head_positions, d, cfg.vocab_size, 1),  # log-prob head
  ]
  rng = np.random.default_rng(0)
  # On an accelerator one product lasts tens of microseconds: time 20
  # queued calls so the dispatch round trip is not counted (a CPU product
  # at these shapes takes milliseconds, one call is enough).
  calls = 1 if jax.default_backend() == 'cpu' else 20
  flops = seconds = 0.0
  for m, k, n, count in shapes:
    x, w, dy = (
      jnp.asarray(rng.standard_normal(s, np.float32))
      for s in ((m, k), (k, n), (m, n))
    )
    t = (
      best_time(lambda x, w: x @ w, x, w, calls=calls)
      + best_time(lambda dy, w: dy @ w.T, dy, w, calls=calls)
      + best_time(lambda xt, dy: xt @ dy, x.T, dy, calls=calls)
    )
    # Per token: 3 products of 2·k·n FLOPs, timed over m tokens.
    flops += count * 3 * 2 * k * n
    seconds += count * t / m
  return flops / seconds


def parser() -> argparse.ArgumentParser:
  """This bench's flags (bench/compare_tunix.py and bench/update_split.py
  build their `Side` from the same ones)."""
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--reps', type=int, default=3)
  ap.add_argument('--preset', default='decoupled_geo_rs')
  ap.add_argument('--mini-batches', type=int, default=1)
  ap.add_argument('--micro-batches', type=int, default=2)
  ap.add_argument('--full-length', action='store_true')
  ap.add_argument('--prompts', type=int, default=bench.PROMPTS)
  ap.add_argument('--new-tokens', type=int, default=bench.NEW)
  ap.add_argument(
    '--remat',
    default='',
    help="model.remat of both sides (default: the config's; 'dots' with "
    "--like); 'A,B' runs remat A against B, both on packed rows",
  )
  ap.add_argument(
    '--dtype',
    default='',
    help="model.dtype of both sides (default: the config's, 'auto'); 'A,B' "
    'runs compute dtype A against B (e.g. float32,bfloat16), both packed',
  )
  ap.add_argument(
    '--like',
    default='',
    help='HF model directory: its shape (config.json), random weights',
  )
  return ap


def main() -> None:
  args = parser().parse_args()
  host = synthetic_batch(
    args.full_length,
    prompts=args.prompts,
    new_tokens=args.new_tokens,
    vocab=vocab_size(args.like),
  )
  real = int(host.segment_ids.sum())
  remat = args.remat or None
  if ',' in args.remat:  # two remat policies, both on packed rows
    sides = {
      f'remat={r}': Side(args, True, host, r) for r in args.remat.split(',')
    }
  elif ',' in args.dtype:  # two compute dtypes (mixed precision), packed
    sides = {
      f'dtype={d}': Side(args, True, host, remat, {'model.dtype': d})
      for d in args.dtype.split(',')
    }
  else:
    sets = {'model.dtype': args.dtype} if args.dtype else None
    sides = {
      'padded': Side(args, False, host, remat, sets),
      'packed': Side(args, True, host, remat, sets),
    }
  first, second = sides
  for s in sides.values():  # compile
    s.step()
  results = {k: [] for k in sides}
  for _ in range(args.reps):
    for name, s in sides.items():
      peak = matmul_peak()
      results[name].append(dict(s.step(), peak=peak))
  cfg = sides[first].cfg
  seq = bench.PROMPT_LEN + args.new_tokens
  fpt = flops_per_token(cfg, seq)
  epochs = sides[first].run.train.ppo_epochs
  print(
    f'backend: {jax.default_backend()} x{jax.device_count()}, '
    f'jax {jax.__version__}; model {cfg.num_params() / 1e6:.2f}M params; '
    f'batch {host.rows} rows x {seq} positions, {real} real tokens '
    f'({real / host.tokens.size:.0%}); preset {args.preset}; '
    f'{args.mini_batches} mini x {args.micro_batches} micro-batches; '
    f'{args.reps} reps'
  )
  print('\nside           computed  step s [min-max]          prepare  update  host'
        '   tok/s   FLOP/peak  ceiling  FLOP/ceiling')  # fmt: skip
  med = statistics.median
  # The head's M: rows x one chunk of the response positions.
  chunk = chunk_length(args.new_tokens, sides[first].run.model.logprob_chunk)
  micro = args.mini_batches * args.micro_batches
  for name, s in sides.items():
    rs = results[name]
    tot = [r['total'] for r in rs]
    rows = s.computed // seq // micro
    ceiling = gemm_ceiling(cfg, rows * seq, rows * chunk)
    # prepare: one forward (π_old); update: forward + backward per epoch.
    rate = [
      fpt * s.computed * (1 + 3 * epochs) / (r['prepare'] + r['update'])
      for r in rs
    ]
    print(
      f'{name:14s} {s.computed:8d}  {med(tot):6.3f} [{min(tot):.3f}-'
      f'{max(tot):.3f}]  {med(r["prepare"] for r in rs):7.3f} '
      f'{med(r["update"] for r in rs):7.3f} {med(r["host"] for r in rs):5.3f}'
      f'  {real / med(tot):7.0f}  {med(f / r["peak"] for f, r in zip(rate, rs)):6.1%}'
      f'    {ceiling / med(r["peak"] for r in rs):5.1%}  {med(rate) / ceiling:6.1%}'
    )
  pairs = [
    a['total'] / b['total'] for a, b in zip(results[first], results[second])
  ]
  print(
    f'\n{second} / {first} train tokens/s: median {med(pairs):.2f}x '
    f'[{min(pairs):.2f}-{max(pairs):.2f}] (paired per repetition); '
    f'peak {med(r["peak"] for r in results[first]) / 1e9:.1f} GFLOP/s'
  )
  if first != 'padded':
    return
  # What packing can give at all when a step's cost follows its positions:
  # the packed rows it used, and no padding whatsoever (sequences split
  # across rows, which attention cannot do).
  padded, packed = sides[first].computed, sides[second].computed
  print(
    f'packing bound: {padded / packed:.2f}x in positions '
    f'({padded} -> {packed}), {padded / real:.2f}x with no padding at all'
  )


if __name__ == '__main__':
  sys.exit(main())
