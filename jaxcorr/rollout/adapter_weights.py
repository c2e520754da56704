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
with the params it will decode with and compares with the log-probs the
trainer computed for v; a gap over `lora.delivery_tol` raises
`AdapterSyncError` at once, so an adapter that never arrived fails loudly
instead of looking like staleness in the rollout-correction metrics
(docs/lora.md). Both sides run the same `DeliveryProbe`: the trainer casts
and merges the version it publishes exactly as the engine does, so the
check compares the engine with what it should hold, not the engine's
precision with the trainer's (a bf16 engine differs from a float32 trainer
by nats on a probe of arbitrary tokens through a real model: 5.9 on
SmolLM2-135M, which no tolerance could tell from a missed sync).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcorr.model import Transformer
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
  """The delivery check's default gap. Both sides run the same program,
  so on one device the gap of a delivered version is 0; the margin covers
  a different reduction order where the engine's mesh shards the matmuls
  differently from the trainer's (float32: 1e-3; 16-bit: 0.1)."""
  return 1e-3 if jnp.dtype(dtype) == jnp.float32 else 0.1


def _cast(dtype: Any) -> Any:
  """A jitted cast of a state's floating leaves to `dtype` (other leaves
  and leaves already in `dtype` copied: the result never aliases)."""

  def cast(x):
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
      return x.astype(dtype)
    return jnp.copy(x)

  return jax.jit(lambda state: jax.tree.map(cast, state))


def _same(a: list, b: list) -> bool:
  return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


class DeliveryProbe:
  """A LoRA engine's weights and its probe log-probs, as functions of the
  trainer's (frozen base, adapters): floating leaves cast to the engine's
  param dtype, then merged into the plain graph (`lora.engine_merged`) or
  kept as the LoRA graph, then the probe row scored. The engine
  (`AdapterWeights`) builds its weights with it; the trainer
  (jaxcorr/train/rollouts/weights.py) calls it on each version it
  publishes, so a delivered version scores the same on both sides.

  Args:
    config: the engine's `TransformerConfig` (its dtypes).
    lora: the adapters' config.
  """

  def __init__(self, config: Any, lora: LoraConfig):
    self.merged = lora.engine_merged
    with_lora = nnx.eval_shape(lambda: lora_model(config, lora))
    self.lora_abstract = nnx.state(with_lora)
    if self.merged:
      abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    else:
      abstract = with_lora
    self.graphdef, self.abstract_state = nnx.split(abstract)
    self.tokens = probe_tokens(config.vocab_size)
    self.cast = _cast(config.param_dtype)
    plain = self.abstract_state
    self._merge = jax.jit(lambda s: merge_into(plain, s, lora.scale))
    graphdef, tokens = self.graphdef, self.tokens
    self._score = jax.jit(lambda p: probe_logprobs(graphdef, p, tokens))
    # The trainer's base never changes: cast it once (keyed by its arrays,
    # since each step's TrainState may wrap them in a new State).
    self._frozen: tuple[list, nnx.State] | None = None

  def assemble(self, frozen: nnx.State, adapter: nnx.State) -> nnx.State:
    """The engine's params from its cast base and cast adapters."""
    full = join(frozen, adapter)
    return self._merge(full) if self.merged else full

  def logprobs(self, params: nnx.State) -> jax.Array:
    """The probe row's log-probs [S - 1] under engine params `params`."""
    return self._score(params)

  def __call__(self, frozen: nnx.State, adapter: nnx.State) -> jax.Array:
    """What the engine must report on the probe once it holds `adapter`
    over base `frozen` (both in the trainer's precision)."""
    leaves = jax.tree.leaves(frozen)
    if self._frozen is None or not _same(self._frozen[0], leaves):
      self._frozen = (leaves, self.cast(frozen))
    return self.logprobs(self.assemble(self._frozen[1], self.cast(adapter)))


class AdapterWeights:
  """The engine's params of a LoRA policy and their policy version (the
  interface of `PolicyWeights`).

  The engine decodes with `delivery.graphdef` (plain when merged, LoRA when
  not).

  Args:
    config: the engine's `TransformerConfig` (its dtypes).
    lora: the adapters' config.
    mesh: the engine mesh (None: the default device, no placement).
    initial: version 0: the trainer's LoRA `Transformer` or its state.
  """

  def __init__(
    self,
    *,
    config: Any,
    lora: LoraConfig,
    mesh: jax.sharding.Mesh | None,
    initial: Any,
  ):
    self.lora = lora
    self.merged = lora.engine_merged
    self.delivery = DeliveryProbe(config, lora)
    self._shardings = self._lora_shardings = None
    if mesh is not None:
      self._shardings = param_shardings(self.delivery.abstract_state, mesh)
      self._lora_shardings = param_shardings(self.delivery.lora_abstract, mesh)
    tol = lora.delivery_tol
    self.tolerance = auto_tolerance(config.dtype) if tol is None else tol
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
    state = self.delivery.cast(state)
    if shardings is not None:
      state = jax.device_put(state, shardings)
    return state

  def _assemble(self, adapter: nnx.State, frozen: nnx.State) -> nnx.State:
    params = self.delivery.assemble(frozen, adapter)
    if self.merged and self._shardings is not None:
      params = jax.device_put(params, self._shardings)
    return params

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
    return np.asarray(self.delivery.logprobs(self.params))

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
