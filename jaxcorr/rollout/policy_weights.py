"""`PolicyWeights`: the weights `PolicyEngine` samples with and the policy
version they belong to.

Trainer params (a `Transformer` or its `nnx.State`) are cast to the engine's
parameter dtype and placed by the sharding rules on the engine mesh; new
weights of the same shapes swap in without recompiling anything. Every token
the engine samples records `version` (docs/async.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcorr.sharding import param_shardings


class PolicyWeights:
  """The engine's current params and their policy version.

  Args:
    abstract_state: the engine model's abstract `nnx.State` (shapes and
      the sharding rules' metadata).
    param_dtype: floating params are cast to it; others stay as they are.
    mesh: the engine mesh (None: the default device, no placement).
    initial: version 0's params.
    quantize: applied to every placed copy (`EngineQuantizer`: narrow
      weights re-quantized at each update); None keeps them as cast.
  """

  def __init__(
    self,
    abstract_state: nnx.State,
    *,
    param_dtype: Any,
    mesh: jax.sharding.Mesh | None,
    initial: Any,
    quantize: Callable[[nnx.State], nnx.State] | None = None,
  ):
    self.param_dtype = param_dtype
    self.quantize = quantize
    self._shardings = (
      None if mesh is None else param_shardings(abstract_state, mesh)
    )
    self.params = self.load(initial)
    self.version = 0

  def load(self, params: Any) -> nnx.State:
    """Trainer params cast to the engine dtype and placed on the engine
    mesh (the current params are untouched)."""
    if isinstance(params, nnx.Module):
      params = nnx.state(params)
    dtype = self.param_dtype

    def cast(x):
      if jnp.issubdtype(x.dtype, jnp.floating):
        return x.astype(dtype)
      return x

    params = jax.tree.map(cast, params)
    if self._shardings is not None:
      params = jax.device_put(params, self._shardings)
    if self.quantize is not None:
      params = self.quantize(params)
    return params

  def update(self, params: Any, version: int | None = None) -> None:
    """Swap in new weights (same shapes: no recompilation); bump the
    policy version (or set it)."""
    self.params = self.load(params)
    self.version = self.version + 1 if version is None else version
