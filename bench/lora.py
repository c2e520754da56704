"""LoRA vs full fine-tuning: weight-sync bytes and time, optimizer memory,
update step time, and decode tokens/s of a merged vs unmerged LoRA engine.

  python bench/lora.py                 # ~5 min on 2 loaded CPU cores
  python bench/lora.py --rank=16 --layers=4 --width=256

Bytes per sync are counted on SmolLM2-135M's shapes
(`jaxcorr.model.smollm2`-sized `TransformerConfig`, abstract: no weights
are read) for the attention-only and all-projection targets at
`--rank`. Everything timed runs on a scratch model of `--layers` x
`--width` (SmolLM2's head/MLP ratios) in float32 on this machine, with the
real components, same process, alternating rounds, medians:

  sync      full: `engine_params` (the trainer's copy of every weight) +
            `PolicyEngine.update_params` (cast + place); LoRA: `AdapterPublisher` (copy the adapters + the
            trainer's probe) + `AdapterWeights.update` (merge or swap,
            then the delivery check)
  optimizer bytes of AdamW's state after `tx.init` (full vs adapters)
  update    one jitted optax step (grad of a next-token loss on a
            [8, 64] batch + AdamW) over every weight vs over the adapters
  decode    `Decoder` tokens/s of 16 rows x 32 new tokens, merged vs
            unmerged engine
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxcorr.model import Transformer, TransformerConfig, token_logprobs
from jaxcorr.model.lora import (
  ATTENTION,
  TARGETS,
  LoraConfig,
  apply_lora,
  lora_model,
  split_adapter,
)
from jaxcorr.rollout.decoder import Decoder, Request
from jaxcorr.rollout.engine import PolicyEngine, SamplingParams
from jaxcorr.train.rollouts.weights import AdapterPublisher, copy_tree


def smollm2_shapes() -> TransformerConfig:
  """SmolLM2-135M's architecture (HF config.json values)."""
  return TransformerConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    tie_embeddings=True,
    scan_layers=True,
  )


def _bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def sync_bytes(rank: int) -> dict[str, float]:
  cfg = smollm2_shapes()
  full = _bytes(
    nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  )
  out = {'full_MB': full / 1e6}
  for name, targets in (('attn', ATTENTION), ('all', TARGETS)):
    lc = LoraConfig(rank=rank, target_modules=targets)
    adapter, _ = split_adapter(
      nnx.state(nnx.eval_shape(lambda lc=lc: lora_model(cfg, lc)))
    )
    out[f'{name}_MB'] = _bytes(adapter) / 1e6
    out[f'{name}_pct'] = 100 * _bytes(adapter) / full
  return out


def _median(fn, n: int) -> float:
  times = []
  for _ in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _train_step(graphdef, tx, frozen):
  """A jitted next-token loss step over `params` (+ `frozen`, not trained)."""

  def loss(params, tokens):
    state = params if frozen is None else nnx.merge_state(frozen, params)
    return -jnp.mean(token_logprobs(nnx.merge(graphdef, state), tokens))

  @jax.jit
  def step(params, opt, tokens):
    g = jax.grad(loss)(params, tokens)
    upd, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, upd), opt

  return step


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument('--rank', type=int, default=16)
  ap.add_argument('--layers', type=int, default=4)
  ap.add_argument('--width', type=int, default=256)
  ap.add_argument('--rounds', type=int, default=5)
  ap.add_argument(
    '--decode_only', action='store_true', help='time decode tokens/s only'
  )
  a = ap.parse_args()
  print('bytes per sync, SmolLM2-135M shapes, rank', a.rank, sync_bytes(a.rank))

  w = a.width
  cfg = TransformerConfig(
    vocab_size=4096,
    hidden_size=w,
    intermediate_size=w * 8 // 3,
    num_layers=a.layers,
    num_heads=4,
    num_kv_heads=2 if w >= 128 else 1,
    scan_layers=True,
  )
  lc = LoraConfig(rank=a.rank, target_modules=TARGETS)
  base = nnx.jit(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))()
  model = nnx.jit(lambda: apply_lora(Transformer(cfg, rngs=nnx.Rngs(0)), lc))()
  full_g, full_p = nnx.split(base)
  lora_g, lora_p = nnx.split(model)
  adapter, frozen = split_adapter(lora_p)
  adapter = jax.tree.map(lambda x: x + 0.01, adapter)  # B != 0

  tx = optax.adamw(1e-4)
  opt_full, opt_lora = tx.init(full_p), tx.init(adapter)
  print(
    f'optimizer state: full {_bytes(opt_full) / 1e6:.2f} MB, LoRA '
    f'{_bytes(opt_lora) / 1e6:.3f} MB ({_bytes(opt_lora) / _bytes(opt_full):.2%})'
  )
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 4096, (8, 64)))
  step_full = _train_step(full_g, tx, None)
  step_lora = _train_step(lora_g, tx, frozen)
  step_full(full_p, opt_full, tokens)
  step_lora(adapter, opt_lora, tokens)

  def engine(m, merged=None):
    return PolicyEngine(
      m,
      max_concurrent_decodes=16,
      max_prefill_length=16,
      max_target_length=64,
      decode_chunk=8,
      lora=None
      if merged is None
      else LoraConfig(**{**vars(lc), 'engine_merged': merged}),
    )

  e_full, e_merged, e_unmerged = (
    engine(base),
    engine(model, True),
    engine(model, False),
  )
  publish = AdapterPublisher(lora_g, cfg.vocab_size)
  e_full.update_params(full_p, 1)
  e_merged.update_params(publish(frozen, adapter), 1)
  e_unmerged.update_params(publish(frozen, adapter), 1)

  def decode(e):
    dec = Decoder(e, sp=SamplingParams(temperature=1.0), max_new_tokens=32)
    keys = np.asarray(jax.random.split(jax.random.PRNGKey(0), 16))
    for i in range(16):
      dec.submit(Request(i, i, 0, [1 + i, 2, 3, 4], keys[i]))
    n = 0
    while dec.busy:
      n += sum(len(r.tokens) for r in dec.advance())
    return n

  for e in (e_merged, e_unmerged):
    decode(e)  # compile
  if a.decode_only:
    _decode_rounds(a.rounds, decode, e_merged, e_unmerged)
    return
  res = {
    k: []
    for k in (
      'sync_full',
      'sync_merged',
      'sync_unmerged',
      'upd_full',
      'upd_lora',
      'tps_merged',
      'tps_unmerged',
    )
  }
  for _ in range(a.rounds):
    res['sync_full'].append(
      _median(
        lambda: e_full.update_params(copy_tree(full_p), 2) or e_full.params,
        1,
      )
    )
    res['sync_merged'].append(
      _median(
        lambda: (
          e_merged.update_params(publish(frozen, adapter), 2) or e_merged.params
        ),
        1,
      )
    )
    res['sync_unmerged'].append(
      _median(
        lambda: (
          e_unmerged.update_params(publish(frozen, adapter), 2)
          or e_unmerged.params
        ),
        1,
      )
    )
    res['upd_full'].append(
      _median(lambda: step_full(full_p, opt_full, tokens), 1)
    )
    res['upd_lora'].append(
      _median(lambda: step_lora(adapter, opt_lora, tokens), 1)
    )
    for name, e in (('merged', e_merged), ('unmerged', e_unmerged)):
      t0 = time.perf_counter()
      n = decode(e)
      res[f'tps_{name}'].append(n / (time.perf_counter() - t0))
  med = {k: statistics.median(v) for k, v in res.items()}
  print(
    f'model {a.layers}x{w}, rank {a.rank}, all projections; medians of {a.rounds} rounds'
  )
  for k, v in med.items():
    print(
      f'  {k:14s} {v * 1e3:9.2f} ms'
      if not k.startswith('tps')
      else f'  {k:14s} {v:9.1f} tok/s'
    )
  print(
    f'  sync LoRA merged / full   {med["sync_merged"] / med["sync_full"]:.2f}x'
  )
  print(f'  update LoRA / full        {med["upd_lora"] / med["upd_full"]:.2f}x')
  print(
    f'  decode unmerged / merged  {med["tps_unmerged"] / med["tps_merged"]:.2f}x'
  )


def _decode_rounds(rounds, decode, e_merged, e_unmerged) -> None:
  """Decode tokens/s only, the order of the two engines alternating."""
  tps = {'merged': [], 'unmerged': []}
  for r in range(rounds):
    pair = [('merged', e_merged), ('unmerged', e_unmerged)]
    for name, e in pair if r % 2 == 0 else pair[::-1]:
      t0 = time.perf_counter()
      n = decode(e)
      tps[name].append(n / (time.perf_counter() - t0))
  med = {k: statistics.median(v) for k, v in tps.items()}
  print(f'decode tok/s medians of {rounds} rounds: {med}')
  print(f'  decode unmerged / merged  {med["unmerged"] / med["merged"]:.2f}x')


if __name__ == '__main__':
  main()
