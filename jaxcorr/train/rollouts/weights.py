"""Copies of the policy's weights that outlive the update's donation: for
the rollout engine (cast, and int8 fake-quantised with
`rollout.simulated_quant`; with LoRA
the adapters only, `AdapterPublisher`), the frozen reference policy and
the SFT warm-up's starting point; and the engine's quantization as the
trainer sees it (`quant_spec`, `matched_params`).

With `rollout.quantization` the published copy stays in the trainer's
precision: the engine quantizes it on its own devices (jaxcorr/rollout/
precision.py), so the narrow weights are derived and never checkpointed
(a fixed-lag checkpoint holds these full-precision copies)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcorr.model.quantized_weights import QuantSpec, fake_quantize
from jaxcorr.rollout.adapter_weights import AdapterUpdate, DeliveryProbe
from jaxcorr.train.rollouts.config import RolloutConfig
from jaxcorr.train.run_config import RunConfig
from jaxcorr.train.state import copy_tree


def fake_quant_int8(x: jax.Array) -> jax.Array:
  """Per-row symmetric int8 quantise + dequantise of a weight matrix
  (vectors such as norm scales and biases stay exact)."""
  if x.ndim < 2 or not jnp.issubdtype(x.dtype, jnp.floating):
    return jnp.copy(x)
  scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0
  scale = jnp.where(scale > 0, scale, 1.0)
  return (jnp.clip(jnp.round(x / scale), -127, 127) * scale).astype(x.dtype)


_quantize = jax.jit(lambda tree: jax.tree.map(fake_quant_int8, tree))


def engine_params(run: RunConfig, params: Any) -> Any:
  """A copy of `params` for the engine (one that later donations cannot
  invalidate), int8 quantize-dequantized if `rollout.simulated_quant`
  says so (the lab's simulated mismatch; a real narrow engine is
  `rollout.quantization`, quantized on the engine's devices)."""
  if run.rollout.simulated_quant == 'int8':
    params = _quantize(params)
  else:
    params = copy_tree(params)
  if jax.process_count() > 1:
    # Each host's engine runs on its own devices: gather the full weights
    # (through the host; fine for the models a per-host engine can hold).
    from jax.experimental import multihost_utils

    params = multihost_utils.process_allgather(params, tiled=True)
  return params


class AdapterPublisher:
  """A LoRA run's weight sync: a copy of the adapters (the only bytes that
  cross to the engine) and the probe log-probs the engine must report
  once it holds them, computed by the engine's own `DeliveryProbe` (its
  dtype, merged or not), which its delivery check compares with what it
  computes (jaxcorr/rollout/adapter_weights.py).

  Args:
    probe: the engine's `DeliveryProbe` (`engine_probe`).
  """

  def __init__(self, probe: DeliveryProbe):
    self._probe = probe

  def __call__(self, frozen: Any, adapter: Any) -> AdapterUpdate:
    """The update of version `adapter` (the trainer's current adapters)."""
    copy = copy_tree(adapter)
    return AdapterUpdate(copy, self._probe(frozen, copy))


def engine_probe(run: RunConfig, config: Any) -> DeliveryProbe:
  """The `DeliveryProbe` of the engine `make_engine` builds for a policy
  of `config`: its dtype is `rollout.engine_dtype`."""
  dtype = jnp.dtype(run.rollout.engine_dtype)
  return DeliveryProbe(config.replace(dtype=dtype, param_dtype=dtype), run.lora)


def weight_sync(run: RunConfig, policy: Any) -> Callable[[Any], Any]:
  """`TrainState` -> what a weight sync sends the engine: `engine_params`
  of its params, or for a LoRA run (`policy`: its
  `jaxcorr.train.policy.Policy`) an `AdapterPublisher` update."""
  if not run.lora.enabled:
    return lambda state: engine_params(run, state.params)
  publish = AdapterPublisher(engine_probe(run, policy.config))
  return lambda state: publish(state.frozen, state.params)


def quant_spec(r: RolloutConfig) -> QuantSpec | None:
  """The engine's `QuantSpec` of a `rollout` section (None: not
  quantized)."""
  if r.quantization == 'none':
    return None
  return QuantSpec(
    r.quantization,
    block=r.quantization_block,
    activations=r.quantize_activations,
  )


def matched_params(run: RunConfig, graphdef: Any, params: Any) -> Any:
  """`params` with each matmul weight replaced by the engine's quantized
  weight, dequantized (`rollout.matched_precision`: π_old from the
  weights the engine sampled with; traced inside `prepare`). Activation
  quantization (W8A8) is not reproduced: weights only."""
  r = run.rollout
  spec = quant_spec(r)
  return fake_quantize(
    nnx.merge(graphdef, params), spec, jnp.dtype(r.engine_dtype)
  )
