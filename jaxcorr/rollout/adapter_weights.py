"""`AdapterWeights`: the engine's weights of a LoRA run, updated by adapter
only, and the delivery check of every update.

The engine keeps its own copy of the frozen base once (cast to its dtype,
on its mesh); each weight sync brings only the adapters (`AdapterUpdate`:
the `nnx.LoRAParam` leaves, a few MB) and the trainer's log-probs of that
version on a fixed probe row (`jaxcorr.model.lora.probe_tokens`). The
engine then decodes either

* merged (`lora.engine_merged=True`): W + alpha / r · A B recomputed from
  the pristine base for each targeted kernel (never accumulated, so no
  drift between versions), the plain `Transformer` graph; or
* unmerged: the LoRA graph, base and adapters side by side.

Delivery check: after installing version v the engine scores the probe
with the params it will decode with and compares with the trainer's
log-probs of v; a gap over `lora.delivery_tol` raises `AdapterSyncError`
at once, so an adapter that never arrived fails loudly instead of looking
like staleness in the rollout-correction metrics (docs/lora.md).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcorr.model.lora import (
  LoraConfig,
  has_lora,
  join,
  lora_model,
  merge_into,
  probe_logprobs,
  probe_tokens,
  split_adapter,
)
from jaxcorr.sharding import param_shardings


class AdapterSyncError(RuntimeError):
  """The engine's weights are not the version the trainer published."""


@flax.struct.dataclass
class AdapterUpdate:
  """What a LoRA weight sync sends: the adapters (an `nnx.State` of
  `nnx.LoRAParam`) and the trainer's probe log-probs under them
  ([S - 1] float32, or None: no check)."""

  adapter: Any
  probe_logp: Any = None


def auto_tolerance(dtype: Any) -> float:
  """The delivery check's default gap: rounding of the engine's dtype
  (float32: the trainer's own numbers; 16-bit: bf16 noise on a probe)."""
  return 1e-3 if jnp.dtype(dtype) == jnp.float32 else 0.1


class AdapterWeights:
  """The engine's params of a LoRA policy and their policy version (the
  interface of `PolicyWeights`).

  Args:
    graphdef: the engine model's graph (plain when merged, LoRA when not).
    abstract_state: the engine model's abstract `nnx.State`.
    config: the engine's `TransformerConfig` (its dtypes).
    lora: the adapters' config.
    mesh: the engine mesh (None: the default device, no placement).
    initial: version 0: the trainer's LoRA `Transformer` or its state.
  """

  def __init__(
    self,
    graphdef: Any,
    abstract_state: nnx.State,
    *,
    config: Any,
    lora: LoraConfig,
    mesh: jax.sharding.Mesh | None,
    initial: Any,
  ):
    self.lora = lora
    self.param_dtype = config.param_dtype
    self.merged = lora.engine_merged
    self.abstract = abstract_state
    lora_abstract = nnx.state(nnx.eval_shape(lambda: lora_model(config, lora)))
    self._shardings = self._lora_shardings = None
    if mesh is not None:
      self._shardings = param_shardings(abstract_state, mesh)
      self._lora_shardings = param_shardings(lora_abstract, mesh)
    tol = lora.delivery_tol
    self.tolerance = auto_tolerance(config.dtype) if tol is None else tol
    self.tokens = probe_tokens(config.vocab_size)
    self._probe = jax.jit(lambda p: probe_logprobs(graphdef, p, self.tokens))
    self._merge = jax.jit(lambda s: merge_into(abstract_state, s, lora.scale))
    full = self._place(self._state(initial), self._lora_shardings)
    self.adapter, self.frozen = split_adapter(full)
    self.params = self._assemble(self.adapter, self.frozen)
    self.version = 0
    self.last_gap: float | None = None

  # ------------------------------------------------------------ loading

  @staticmethod
  def _state(params: Any) -> nnx.State:
    if isinstance(params, nnx.Module):
      return nnx.state(params)
    return params

  def _place(self, state: Any, shardings: Any) -> Any:
    """The engine's own copy (the trainer donates its arrays): floating
    leaves cast to the engine dtype, placed by `shardings`."""
    dtype = self.param_dtype

    def cast(x):
      if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
        return x.astype(dtype)
      return jnp.copy(x)

    state = jax.tree.map(cast, state)
    if shardings is not None:
      state = jax.device_put(state, shardings)
    return state

  def _assemble(self, adapter: nnx.State, frozen: nnx.State) -> nnx.State:
    full = join(frozen, adapter)
    if not self.merged:
      return full
    merged = self._merge(full)
    if self._shardings is not None:
      merged = jax.device_put(merged, self._shardings)
    return merged

  def _adapter_of(self, params: Any) -> tuple[nnx.State, nnx.State]:
    """(adapter placed for the engine, the frozen base to join it with)."""
    if isinstance(params, AdapterUpdate):
      params = params.adapter
    state = self._state(params)
    adapter, frozen = split_adapter(state)
    if jax.tree.leaves(frozen):  # a whole LoRA state: its own base
      full = self._place(state, self._lora_shardings)
      return split_adapter(full)
    if not has_lora(adapter):
      raise ValueError('a LoRA engine takes adapters (nnx.LoRAParam leaves)')
    shard = None
    if self._lora_shardings is not None:
      shard, _ = split_adapter(self._lora_shardings)
    return self._place(adapter, shard), self.frozen

  def load(self, params: Any) -> nnx.State:
    """The engine params for `params` (an `AdapterUpdate`, adapters, or a
    whole LoRA state / module); the current params are untouched."""
    return self._assemble(*self._adapter_of(params))

  def update(self, params: Any, version: int | None = None) -> None:
    """Swap in new adapters (no recompilation); bump the policy version
    (or set it); then the delivery check when `params` carries the
    trainer's probe log-probs."""
    adapter, frozen = self._adapter_of(params)
    self.adapter, self.frozen = adapter, frozen
    self.params = self._assemble(adapter, frozen)
    self.version = self.version + 1 if version is None else version
    expected = getattr(params, 'probe_logp', None)
    if expected is not None and self.tolerance > 0:
      self.check(expected)

  # ------------------------------------------------------------- check

  def probe(self) -> np.ndarray:
    """The engine's log-probs of the probe row under its current params."""
    return np.asarray(self._probe(self.params))

  def check(self, expected: Any) -> float:
    """Raises `AdapterSyncError` when the engine's probe log-probs differ
    from `expected` (the trainer's, same version) by more than the
    tolerance; returns the gap."""
    gap = float(np.max(np.abs(self.probe() - np.asarray(expected))))
    self.last_gap = gap
    if not gap <= self.tolerance:
      raise AdapterSyncError(
        f'weight sync to policy version {self.version} not delivered: the '
        f"engine's log-probs on the probe differ from the trainer's for "
        f'that version by {gap:.3g} > config.lora.delivery_tol='
        f'{self.tolerance:g}. The engine would sample with other weights '
        'than the version its tokens record (this is not staleness)'
      )
    return gap
