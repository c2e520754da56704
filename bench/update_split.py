"""Where the update step's time goes: its parts as separately jitted calls.

  python bench/update_split.py --reps=3            # full-length batch
  python bench/update_split.py --reps=3 --realistic
  python bench/update_split.py --realistic --like=DIR   # a real model's shape

The batch, model and config of `bench/compare_tunix.py --part=train`
(bench/update.py's `Side`: 64 rows x (32 + 128) tokens, the 4.2M-param
bench model, fp32, `bypass_ppo_clip`, 1 mini- and micro-batch, packed).
Each line is one jitted function on the same inputs, timed alternately
(median of `--reps` warm calls):

  update             `Steps.update`: the whole optimizer step
  prepare            `Steps.prepare`
  loss fwd+bwd       the actor loss of the micro-batch, value and
                     gradients (no optimizer)
  trunk fwd+bwd      the layers alone (`hidden_states`), forward and VJP
  head <variant>     the chunked log-prob head alone on those hidden
                     states, forward + VJP, with / without the vocabulary
                     entropy and `jax.checkpoint` per chunk (`remat`)
  head full logits   the head as Tunix computes it: `[B, T, V]` logits,
                     log_softmax, forward + VJP
  optimizer          `apply_updates` (AdamW) on gradients of the params'
                     shapes

The parts overlap (the loss contains the trunk and the head), so they do
not add up to the update; differences between lines are the split.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import update  # bench/update.py: the bench batch and one side's state
from flax import nnx

from jaxcorr.model import logprobs_from_hidden
from jaxcorr.model.layers import matmul_precision
from jaxcorr.train import batch as batch_lib
from jaxcorr.train import step as step_lib
from jaxcorr.train.packing import forward as packed_forward
from jaxcorr.train.state import apply_updates


def _timer(fn, *args):
  def run():
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0

  print(f'compiled in {run():.1f} s', flush=True)
  return run


def _head_fn(cfg, chunk, entropy, remat):
  def f(hidden, head, targets, temp, w):
    out = logprobs_from_hidden(
      hidden,
      head,
      targets,
      temperature=temp,
      chunk_size=chunk,
      return_entropy=entropy,
      dtype=cfg.dtype,
      precision=matmul_precision(cfg),
      real_vocab_size=cfg.real_vocab_size,
      remat=remat,
    )
    logp, ent = out if entropy else (out, jnp.zeros(()))
    return jnp.sum(logp * w), jnp.sum(ent)

  return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))


def _full_logits(hidden, head, targets, w):
  def f(hidden, head):
    logits = jnp.einsum('btd,vd->btv', hidden, head)
    logp = jax.nn.log_softmax(logits, -1)
    picked = jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return jnp.sum(picked * w)

  return jax.value_and_grad(f, argnums=(0, 1))(hidden, head)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--reps', type=int, default=3)
  ap.add_argument('--realistic', action='store_true')
  ap.add_argument('--preset', default='bypass_ppo_clip')
  ap.add_argument(
    '--like',
    default='',
    help='HF model directory: its shape (config.json), random weights',
  )
  ap.add_argument(
    '--micro-batches',
    type=int,
    default=1,
    help='the parts other than update and prepare time micro-batch 0',
  )
  ap.add_argument(
    '--skip',
    default='',
    help='comma-separated parts not to run (e.g. "remat=never,full logits": '
    'at SmolLM2 size their [B, T, V] logits take several GiB)',
  )
  args = ap.parse_args()
  ns = update.parser().parse_args(
    [
      f'--preset={args.preset}',
      f'--micro-batches={args.micro_batches}',
      f'--like={args.like}',
    ]
  )
  batch = update.synthetic_batch(
    not args.realistic, vocab=update.vocab_size(args.like)
  )
  side = update.Side(ns, True, batch)
  side.step()
  steps, run, cfg = side.steps, side.run, side.cfg
  with jax.set_mesh(side.mesh):
    packed = packed_forward.to_device(side.mesh, side.packed)
    dev = batch_lib.to_device(side.mesh, side.host)
    _, prepared, _ = steps.prepare(
      side.state.params, None, side.state.kl_ctrl, None, dev, packed
    )
    # Copies: the update donates the state it is given.
    params = jax.tree.map(jnp.copy, side.state.params)
    opt_state = jax.tree.map(jnp.copy, side.state.opt_state)
    kl = jax.tree.map(jnp.copy, side.state.kl_ctrl)
    sub, micros = packed_forward.minibatch(prepared, packed, 0)
    micro = jax.tree.map(lambda x: x[0], micros)
    mic = packed_forward.micro_view(sub, micro.member)
    counts = (jnp.float32(1), jnp.float32(1))
    key = jax.random.PRNGKey(0)

    def loss(p):
      return step_lib._actor_loss(run, steps.graphdef, p, mic, counts, key,
                                  micro)  # fmt: skip

    model = nnx.merge(steps.graphdef, params)

    def trunk(p):
      m = nnx.merge(steps.graphdef, p)
      h, _ = m.hidden_states(
        micro.tokens, positions=micro.positions, segment_ids=micro.segment_ids
      )
      return h

    hidden = jax.jit(trunk)(params)
    cot = jnp.ones_like(hidden)

    def trunk_bwd(p):
      _, vjp = jax.vjp(trunk, p)
      return vjp(cot)

    h_in = hidden[:, :-1]
    head = model.head_weight()
    targets = micro.tokens[:, 1:]
    temp = micro.temperature[:, :-1]
    w = jnp.ones(targets.shape, jnp.float32)
    grads = jax.tree.map(jnp.ones_like, params)
    opt = jax.jit(lambda g, s, p: apply_updates(steps.tx, g, s, p, None))

    def update_fn():
      side.state, met = steps.update(side.state, prepared, packed)
      return side.state, met

    chunk = run.model.logprob_chunk
    # (function, arguments) per part; each is compiled when it is kept.
    calls = {
      'update': (update_fn,),
      'prepare': (steps.prepare, params, None, kl, None, dev, packed),
      'loss fwd+bwd': (
        jax.jit(jax.value_and_grad(loss, has_aux=True)),
        params,
      ),
      'trunk fwd+bwd': (jax.jit(trunk_bwd), params),
    }
    for ent in (True, False):
      for remat in ('always', 'never'):
        calls[f'head entropy={ent:d} remat={remat}'] = (
          _head_fn(cfg, chunk, ent, remat),
          h_in,
          head,
          targets,
          temp,
          w,
        )
    calls['head full logits'] = (jax.jit(_full_logits), h_in, head, targets, w)
    calls['optimizer'] = (opt, grads, opt_state, params)
    skip = [x for x in args.skip.split(',') if x]
    parts = {
      k: _timer(*c) for k, c in calls.items() if not any(x in k for x in skip)
    }
    times = {k: [] for k in parts}
    for _ in range(args.reps):
      for k, f in parts.items():
        times[k].append(f())
        print(f'{k}: {times[k][-1] * 1e3:.0f} ms', flush=True)
  print(
    f'backend {jax.default_backend()}, jax {jax.__version__}; packed rows '
    f'{tuple(micro.tokens.shape)}; preset {args.preset}; '
    f'{"realistic" if args.realistic else "full"} lengths; '
    f'{args.reps} reps; log-prob chunk {chunk}'
  )
  for k, v in times.items():
    print(
      f'{k:28s} {statistics.median(v) * 1e3:9.1f} ms '
      f'[{min(v) * 1e3:.0f}-{max(v) * 1e3:.0f}]'
    )


if __name__ == '__main__':
  sys.exit(main())
