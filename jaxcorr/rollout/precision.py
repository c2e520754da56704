"""The engine's precision knobs (docs/precision.md): quantized weights,
re-quantized on device at every weight sync, and the KV cache's storage
dtype.

`EngineQuantizer` turns published weights (the trainer's, already cast to
the engine dtype and placed on the engine's devices) into the engine's
narrow state (`jaxcorr.model.quantized_weights.quantize_state`) in one
jitted call: scales are recomputed from the new weights each time, and the
result has the same structure and shapes every time, so decode never
recompiles across syncs.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcorr.model import quantized_weights
from jaxcorr.model.quantized_cache import KV_QTYPES
from jaxcorr.model.quantized_weights import QuantSpec, quantize_state

FP8_MATMUL_BACKENDS = ('gpu', 'cuda')
"""Backends whose matmuls take fp8 operands (W8A8 fp8); fp8 weight-only
storage works everywhere (the weights are converted before the dot)."""


def kv_storage_dtype(name: str | None) -> Any:
  """A `rollout.kv_cache_dtype` name -> the cache's storage dtype (None:
  the engine dtype)."""
  if name in (None, 'model'):
    return None
  if name in KV_QTYPES:
    return KV_QTYPES[name]
  return jnp.dtype(name)


def unsupported(spec: QuantSpec | None, backend: str) -> str | None:
  """Why `spec` cannot run on `backend` (None: it can)."""
  if spec is None or not spec.activations or spec.scheme != 'fp8':
    return None
  if backend in FP8_MATMUL_BACKENDS:
    return None
  return (
    f'fp8 activations need fp8 matmuls ({", ".join(FP8_MATMUL_BACKENDS)}); '
    f'this backend is {backend!r}: use int8 activations or fp8 weight-only'
  )


def block_refusal(config: Any, block: int) -> tuple[str, str] | None:
  """(allowed values, why) when `rollout.quantization_block` = `block`
  tiles some matmul weight of a policy of `config` (a `TransformerConfig`)
  in no layout of n consecutive inputs; None when it tiles them all
  (`quantized_weights.block_refusal` on the abstract model: no arrays)."""
  from jaxcorr.model import Transformer

  model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  return quantized_weights.block_refusal(model, block)


def stored_dtypes(engine: Any) -> dict[str, str]:
  """`RolloutBatch.param_dtype` / `kv_cache_dtype` of a `PolicyEngine`:
  the dtypes its matmul weights and KV cache are stored in (int8 /
  float8_e4m3fn when narrow), not its compute dtype."""
  cfg = engine.config
  quantize = getattr(engine.weights, 'quantize', None)  # LoRA: never
  param = cfg.param_dtype if quantize is None else quantize.spec.qtype
  kv = engine.layout.kv_dtype or cfg.dtype
  return {
    'param_dtype': jnp.dtype(param).name,
    'kv_cache_dtype': jnp.dtype(kv).name,
  }


class EngineQuantizer:
  """Published weights -> the engine's quantized `nnx.State` (jitted once
  per engine; `last_seconds`: the newest call's wall time, blocked)."""

  def __init__(self, graphdef: nnx.GraphDef, spec: QuantSpec):
    self.spec = spec

    def quantize(state):
      return quantize_state(nnx.merge(graphdef, state), spec)

    self._fn = jax.jit(quantize)
    self.last_seconds = 0.0

  def __call__(self, state: nnx.State) -> nnx.State:
    start = time.perf_counter()
    out = jax.block_until_ready(self._fn(state))
    self.last_seconds = time.perf_counter() - start
    return out


def quantizer(
  graphdef: nnx.GraphDef, spec: QuantSpec | None
) -> EngineQuantizer | None:
  """The engine's `EngineQuantizer` for `spec` (None: not quantized)."""
  return None if spec is None else EngineQuantizer(graphdef, spec)
