"""Precision benchmark (docs/precision.md): what `rollout.quantization` and
`rollout.kv_cache_dtype` cost and save, all in one run.

1. Bytes (exact, from the engine's own arrays under `jax.eval_shape`):
   engine weight bytes per precision vs bf16, scales included, for the
   bench model below and for SmolLM2-135M's shapes; KV-cache bytes per
   token per precision (scales included).
2. The largest batch x length an engine of SmolLM2-135M's shapes fits in a
   fixed memory budget (weights + KV cache only; activations excluded),
   per precision.
3. Rollout tokens/s per precision on this machine: `driver.generate` of
   16 prompts x 4 samples, 32-token prompts, 64 new tokens, no stop
   tokens, temperature 1, on the 5M-param Llama-style model of
   bench/rollout.py; repetitions alternate between the engines (same
   background load); median tokens/s and the median paired ratio to bf16.
4. Re-quantization per weight sync: `update_params` wall time (cast,
   place, quantize on device, blocked) per precision, and as a fraction
   of one sync-mode rollout of the workload above (a lower bound on a
   step, so an upper bound on the fraction).

Usage: python bench/precision.py [--reps 3] [--budget-gib 1.0]
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
from jaxcorr.model.quantized_weights import (
  QuantSpec,
  quantize_state,
  stored_bytes,
)
from jaxcorr.rollout import decode, driver, precision
from jaxcorr.rollout.engine import PolicyEngine

PROMPTS, SAMPLES, PROMPT_LEN, NEW = 16, 4, 32, 64
BENCH = dict(
  architecture='LlamaForCausalLM',
  vocab_size=4096,
  hidden_size=256,
  intermediate_size=768,
  num_layers=4,
  num_heads=8,
  num_kv_heads=4,
  rope_theta=1e6,
)
SMOLLM2 = dict(
  architecture='LlamaForCausalLM',
  vocab_size=49152,
  hidden_size=576,
  intermediate_size=1536,
  num_layers=30,
  num_heads=9,
  num_kv_heads=3,
  tie_embeddings=True,
)
# name -> (engine dtype, QuantSpec or None, kv_cache_dtype)
PRECISIONS = {
  'fp32': ('float32', None, None),
  'bf16': ('bfloat16', None, None),
  'int8': ('bfloat16', QuantSpec('int8'), None),
  'int8-b64': ('bfloat16', QuantSpec('int8', block=64), None),
  'fp8': ('bfloat16', QuantSpec('fp8'), None),
  'int8-w8a8': ('bfloat16', QuantSpec('int8', activations=True), None),
  'int8+kv8': ('bfloat16', QuantSpec('int8'), 'int8'),
  'fp8+kvfp8': ('bfloat16', QuantSpec('fp8'), 'fp8'),
}
TIMED = ('bf16', 'fp32', 'int8', 'fp8', 'int8-w8a8', 'int8+kv8')


def _config(shapes: dict, dtype: str) -> TransformerConfig:
  d = jnp.dtype(dtype)
  return TransformerConfig(**shapes, dtype=d, param_dtype=d)


def weight_bytes(shapes: dict, name: str) -> int:
  dtype, spec, _ = PRECISIONS[name]
  cfg = _config(shapes, dtype)

  def build():
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    if spec is None:
      return nnx.state(model)
    return quantize_state(model, spec)

  return stored_bytes(jax.eval_shape(build))


def kv_bytes_per_token(shapes: dict, name: str) -> float:
  """Cache bytes of one slot per token (all layers, k and v, scales)."""
  dtype, _, kv = PRECISIONS[name]
  cfg = _config(shapes, dtype)
  sp = jnp.zeros((4,), jnp.float32)
  state = jax.eval_shape(
    lambda: decode.init_state(cfg, 1, 64, sp, precision.kv_storage_dtype(kv))
  )
  return stored_bytes((state.cache.k, state.cache.v)) / 64


def bytes_table(budget: float) -> None:
  print('== 1. engine bytes (scales included), ratio to bf16 ==')
  for label, shapes in (('bench 5M', BENCH), ('SmolLM2-135M', SMOLLM2)):
    base = weight_bytes(shapes, 'bf16')
    kv0 = kv_bytes_per_token(shapes, 'bf16')
    print(
      f'-- {label}: bf16 weights {base / 2**20:.2f} MiB, KV {kv0:.0f} B/token'
    )
    for name in PRECISIONS:
      w, kv = weight_bytes(shapes, name), kv_bytes_per_token(shapes, name)
      print(
        f'  {name:10s} weights {w / 2**20:8.2f} MiB ({w / base:.3f}x)   '
        f'KV {kv:7.0f} B/token ({kv / kv0:.3f}x)'
      )
  print(f'== 2. SmolLM2-135M shapes in a {budget / 2**30:.2f} GiB budget ==')
  for name in PRECISIONS:
    w = weight_bytes(SMOLLM2, name)
    kv = kv_bytes_per_token(SMOLLM2, name)
    tokens = int((budget - w) // kv)
    print(
      f'  {name:10s} {tokens:9d} cached tokens = batch {tokens // 1024:5d} x '
      f'1024 tokens (= {tokens // 4096} x 4096)'
    )


def _engine(model, name: str) -> PolicyEngine:
  dtype, spec, kv = PRECISIONS[name]
  return PolicyEngine(
    model,
    max_concurrent_decodes=PROMPTS * SAMPLES,
    max_prefill_length=PROMPT_LEN,
    max_target_length=PROMPT_LEN + NEW,
    dtype=jnp.dtype(dtype),
    quantization=spec,
    kv_cache_dtype=kv,
  )


def _generate(engine, prompts, seed) -> float:
  start = time.perf_counter()
  batch = driver.generate(
    engine,
    prompts,
    num_samples=SAMPLES,
    max_new_tokens=NEW,
    temperature=1.0,
    stop_token_ids=(),
    seed=seed,
  )
  wall = time.perf_counter() - start
  return float(batch.response_mask.sum()) / wall


def _sync_seconds(engine, state) -> float:
  start = time.perf_counter()
  engine.update_params(state)
  jax.block_until_ready(engine.params)
  return time.perf_counter() - start


def timings(reps: int) -> None:
  cfg = TransformerConfig(**BENCH)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  state = nnx.state(model)
  rng = np.random.default_rng(0)
  prompts = rng.integers(3, cfg.vocab_size, (PROMPTS, PROMPT_LEN)).tolist()
  engines = {name: _engine(model, name) for name in TIMED}
  for eng in engines.values():  # compile every shape once
    _generate(eng, prompts, 100)
    _sync_seconds(eng, state)
  tps = {name: [] for name in TIMED}
  sync = {name: [] for name in TIMED}
  for r in range(reps):
    for name, eng in engines.items():
      tps[name].append(_generate(eng, prompts, r))
      sync[name].append(_sync_seconds(eng, state))
  print(f'== 3./4. rollout tokens/s and weight sync ({jax.devices()[0]}) ==')
  base = tps['bf16']
  for name in TIMED:
    ratio = statistics.median(np.array(tps[name]) / np.array(base))
    t = statistics.median(tps[name])
    s = statistics.median(sync[name])
    rollout_s = PROMPTS * SAMPLES * NEW / t
    print(
      f'  {name:10s} {t:8.0f} tok/s ({ratio:.2f}x bf16)   sync '
      f'{s * 1e3:7.1f} ms = {s / rollout_s:.3f} of one rollout '
      f'({rollout_s:.2f} s)'
    )


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--reps', type=int, default=3)
  parser.add_argument('--budget-gib', type=float, default=1.0)
  parser.add_argument('--skip-timings', action='store_true')
  args = parser.parse_args()
  bytes_table(args.budget_gib * 2**30)
  if not args.skip_timings:
    timings(args.reps)


if __name__ == '__main__':
  main()
