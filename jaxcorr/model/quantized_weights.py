"""Narrow (int8 / fp8) storage of a `Transformer`'s matmul weights, for the
rollout engine (docs/precision.md).

`quantize_state(model, spec)` returns the model's `nnx.State` with every
matmul weight — each `Linear` kernel, the embedding and an untied
`lm_head` — replaced by a `QuantizedWeight`: a qwix `QArray` (values in
int8 or float8_e4m3fn, float32 absmax scales) and, statically, whether
activations are quantized too. Norm scales and biases stay in the model
dtype. The state has a fixed structure for a given model and spec, so the
jitted decode programs compile once and every re-quantization (each
weight sync) swaps arrays of the same shapes and dtypes.

Scales: one per output channel (every kernel axis the projection does not
contract over, the stacked-layers axis included: per layer), or with
`block` > 0 one per output channel and block of `block` consecutive inputs
in the flattened (HF, head-major) input order (`block_tiles`): o_proj
[H, Dh, D] with a block dividing Dh gets a scale per head and block, one
that is a multiple of Dh a scale per group of block / Dh heads. A block
that tiles no weight's inputs this way is refused at config time
(`block_refusal`), never silently per channel. The embedding's scale is
per vocabulary row, which is also its output channel as the tied head.

The forward reads a `QuantizedWeight` through `project` and `embed_rows`:
weight-only dequantizes the kernel to the compute dtype inside the jitted
program (XLA fuses the convert and scale into the dot's operand; the
narrow array is what lives in memory), weight+activation quantizes each
token's activations to the same type and runs the narrow dot through
`qwix.einsum` (int8 x int8 -> int32 on every backend; fp8 x fp8 only
where the hardware has it, checked by `jaxcorr.train.build`).

qwix does the numerics (calibration, rounding, `QArray`, the quantized
einsum); its model-rewriting `quantize_model` is not used because it
intercepts calls during a traced forward to find weights, which the
engine's graph-splitting programs (one graphdef, params passed as jit
arguments and re-quantized at every sync) do not go through.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from jaxcorr.model.projection import dense_einsum

QTYPES = {'int8': jnp.int8, 'fp8': jnp.float8_e4m3fn}
"""`rollout.quantization` name -> storage dtype (fp8 is e4m3, the format
inference uses for weights)."""


@dataclasses.dataclass(frozen=True)
class QuantSpec:
  """How to quantize the weights.

  scheme: 'int8' or 'fp8'. block: 0 per output channel, else scales per
  output channel and block of this many consecutive inputs (module doc;
  every weight's inputs must tile, `block_refusal`). activations: quantize
  activations per token to the same type before each projection
  (W8A8)."""

  scheme: str
  block: int = 0
  activations: bool = False

  def __post_init__(self):
    if self.scheme not in QTYPES:
      raise ValueError(
        f'QuantSpec.scheme: invalid value {self.scheme!r}; allowed: '
        + ', '.join(repr(k) for k in QTYPES)
      )

  @property
  def qtype(self) -> Any:
    return QTYPES[self.scheme]


@flax.struct.dataclass
class QuantizedWeight:
  """A matmul weight stored narrow: `weight.qvalue` (int8 / fp8, the
  kernel's shape), `weight.scale` (float32, broadcastable to it)."""

  weight: qwix.QArray
  # Static: whether activations are quantized before the dot (W8A8).
  act_qtype: Any = flax.struct.field(pytree_node=False, default=None)

  @property
  def shape(self) -> tuple[int, ...]:
    return self.weight.qvalue.shape

  def dequantize(self, dtype: Any) -> jax.Array:
    """The weight the forward computes with, in `dtype`."""
    return qwix.dequantize(self.weight.astype(jnp.float32)).astype(dtype)


def _kernel_axes(equation: str, ndim: int) -> tuple[tuple[int, ...], int]:
  """(contracted kernel axes, rank of x) of a `Linear` einsum; a stacked
  kernel has leading axes the equation does not name."""
  lhs, kernel = equation.split('->')[0].split(',')
  offset = ndim - len(kernel)
  return tuple(offset + i for i, c in enumerate(kernel) if c in lhs), len(lhs)


def block_tiles(
  shape: tuple[int, ...], contract: tuple[int, ...], block: int
) -> tuple[tuple[int, ...], dict[int, int]] | None:
  """(extra per-index axes, {axis: tile}) that make each scale cover
  `block` consecutive inputs of the flattened contracted axes (kernel
  order: head-major for o_proj), or None when no such layout exists.

  From the innermost contracted axis out: the first axis `a` where
  `block` = t x (the size of the axes inside it) with t dividing a's size
  is tiled by t, the axes inside it share the scale, and the contracted
  axes outside it get a scale per index. o_proj [H, Dh, D], Dh = 64:
  block 16 tiles Dh by 16 (a scale per head too); 128 tiles H by 2."""
  inner = 1
  for i in range(len(contract) - 1, -1, -1):
    size = shape[contract[i]]
    if block % inner == 0 and size % (block // inner) == 0:
      return contract[:i], {contract[i]: block // inner}
    inner *= size
  return None


def _quantize(x: jax.Array, contract: tuple[int, ...], spec: QuantSpec):
  channel = tuple(a for a in range(x.ndim) if a not in contract)
  tiled = None
  if spec.block:
    layout = block_tiles(x.shape, contract, spec.block)
    if layout is None:
      raise ValueError(
        f'quantization block {spec.block} tiles no layout of a weight '
        f'{x.shape} contracting axes {contract} (block_refusal)'
      )
    channel, tiled = tuple(sorted(channel + layout[0])), layout[1]
  q = qwix.quantize(
    x.astype(jnp.float32),
    spec.qtype,
    channelwise_axes=channel,
    tiled_axes=tiled,
  )
  act = spec.qtype if spec.activations else None
  return QuantizedWeight(q, act)


def weight_plan(model: nnx.Module) -> dict[tuple, tuple[int, ...]]:
  """State path of each quantizable weight -> its contracted axes (the
  axes that share a scale)."""
  plan = {}
  for path, node in nnx.iter_graph(model):
    equation = getattr(node, 'equation', None)
    kernel = getattr(node, 'kernel', None)
    if isinstance(equation, str) and isinstance(kernel, nnx.Param):
      plan[(*path, 'kernel')] = _kernel_axes(equation, kernel.ndim)[0]
  for name in ('embed', 'lm_head'):
    table = getattr(model, name, None)
    if isinstance(table, nnx.Param):
      plan[(name,)] = (table.ndim - 1,)  # [(L,) V, D]: contract D
  return plan


def block_refusal(model: nnx.Module, block: int) -> tuple[str, str] | None:
  """(allowed values, why) when `block` tiles the inputs of some matmul
  weight of `model` (an abstract one will do) in no `block_tiles` layout;
  None when it tiles every one."""
  values = dict(nnx.to_flat_state(nnx.state(model)))
  inputs: dict[tuple[int, ...], list[str]] = {}  # contracted sizes -> names
  for path, contract in weight_plan(model).items():
    shape = values[path].get_value().shape
    name = path[-2] if path[-1] == 'kernel' else path[-1]
    names = inputs.setdefault(tuple(shape[a] for a in contract), [])
    names.append(str(name)) if str(name) not in names else None
  tiles = lambda sizes, n: block_tiles(sizes, tuple(range(len(sizes))), n)  # noqa: E731
  bad = [sizes for sizes in inputs if tiles(sizes, block) is None]
  if not bad:
    return None
  allowed = set.intersection(
    *(
      {n for n in range(1, math.prod(v) + 1) if tiles(v, n) is not None}
      for v in inputs
    )
  )
  dims = '; '.join(
    f'{"/".join(inputs[v])} contract {" x ".join(map(str, v))}' for v in bad
  )
  return (
    '0 (one scale per output channel) or a block that tiles every '
    f'weight: {", ".join(map(str, sorted(allowed)))}',
    f'{dims} inputs, which do not split into blocks of {block} '
    'consecutive inputs',
  )


def quantize_state(model: nnx.Module, spec: QuantSpec) -> nnx.State:
  """`nnx.state(model)` with the matmul weights as `QuantizedWeight`s
  (call it under `jax.jit`: the narrow arrays are made on device)."""
  plan = weight_plan(model)
  state = nnx.state(model)
  flat = dict(nnx.to_flat_state(state))
  for path, contract in plan.items():
    var = flat[path]
    flat[path] = var.replace(_quantize(var.get_value(), contract, spec))
  return nnx.from_flat_state(flat)


def dequantize_state(state: nnx.State, dtype: Any) -> nnx.State:
  """Every `QuantizedWeight` of `state` back to a plain array in `dtype`
  (the weights a quantized forward computes with)."""
  flat = dict(nnx.to_flat_state(state))
  for path, var in flat.items():
    value = var.get_value()
    if isinstance(value, QuantizedWeight):
      flat[path] = var.replace(value.dequantize(dtype))
  return nnx.from_flat_state(flat)


def fake_quantize(model: nnx.Module, spec: QuantSpec, dtype: Any) -> nnx.State:
  """The model's state with each matmul weight cast to `dtype` (the
  engine's), quantized as `spec` and dequantized in float32: the exact
  weights an engine of that dtype samples with, in the trainer's layout
  (`rollout.matched_precision`)."""
  flat = dict(nnx.to_flat_state(nnx.state(model)))
  for path, contract in weight_plan(model).items():
    x = flat[path].get_value()
    q = _quantize(x.astype(dtype), contract, spec)
    flat[path] = flat[path].replace(q.dequantize(jnp.float32).astype(x.dtype))
  return nnx.from_flat_state(flat)


def stored_bytes(tree: Any) -> int:
  """Bytes of every array in `tree` (quantized values and scales
  included)."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


# ------------------------------------------------------------ the forward


def project(
  equation: str,
  x: jax.Array,
  kernel: Any,
  dtype: Any,
  precision: Any = None,
  preferred_element_type: Any = None,
) -> jax.Array:
  """`einsum(equation, x, kernel)` in `dtype` for a plain or quantized
  kernel (see the module docstring). A plain kernel goes through
  `dense_einsum` (jaxcorr/model/projection.py) for its weight gradient."""
  x = x.astype(dtype)
  if not isinstance(kernel, QuantizedWeight):
    return dense_einsum(
      equation, x, kernel.astype(dtype), precision, preferred_element_type
    )
  if kernel.act_qtype is None:
    w = kernel.dequantize(dtype)
  else:
    lhs = equation.split('->')[0].split(',')[0]
    rhs = equation.split('->')[0].split(',')[1]
    tokens = tuple(i for i, c in enumerate(lhs) if c not in rhs)
    qx = qwix.quantize(
      x.astype(jnp.float32), kernel.act_qtype, channelwise_axes=tokens
    )
    out = qwix.einsum(equation, qx, kernel.weight)
    return out.astype(preferred_element_type or dtype)
  return jnp.einsum(
    equation,
    x,
    w,
    precision=precision,
    preferred_element_type=preferred_element_type,
  )


def embed_rows(table: Any, tokens: jax.Array, dtype: Any) -> jax.Array:
  """Rows `tokens` of an embedding table (plain or quantized), in
  `dtype`: only the looked-up rows are dequantized."""
  if not isinstance(table, QuantizedWeight):
    return jnp.take(table, tokens, axis=0).astype(dtype)
  w = table.weight
  rows = qwix.QArray(
    jnp.take(w.qvalue, tokens, axis=0),
    jnp.take(w.scale, tokens, axis=0).astype(jnp.float32),
    qtype=w.qtype,
  )
  return qwix.dequantize(rows).astype(dtype)
