"""Device mesh, the one logical-axis rules table, and shardings built from it.

Models name *logical* axes only (`('embed', 'mlp')` for an MLP kernel,
`('batch', 'seq', 'act_embed')` for an activation); `LOGICAL_RULES` is the
single place that maps them onto the mesh axes `data`, `fsdp`, `sequence`
and `tensor`:

* `data`: pure data parallelism (params replicated across it);
* `fsdp`: data parallelism whose params and optimizer state are sharded
  (ZeRO-3): every weight's `embed` dimension is split over it;
* `sequence`: context parallelism: each row's positions are split over it
  (activations' `seq` dimension), and, as its devices see different tokens
  of the same rows, it shards the weights' `embed` dimension too (ZeRO-3
  over fsdp x sequence: the gradient is reduced over both anyway).
  Attention gathers keys and values over it
  (`jaxcorr/model/context_parallel.py`); the rollout engine never splits
  rows (`engine_mesh`);
* `tensor`: Megatron-style tensor parallelism over heads, MLP width and vocab.

The batch is split over `data` x `fsdp` together. A `sequence` axis of size
1 is left out of every spec, so a mesh without context parallelism shards
exactly as before the axis existed. A mesh axis is dropped from
a dimension it does not divide (2 KV heads on a tensor axis of 4 are
replicated), and never used twice in one spec, so every rule is safe for any
model size; `docs/models.md` gives the usual mesh for 0.5B to 70B.

The mesh uses `AxisType.Auto` axes: the model is written for GSPMD-style
propagation from parameter and batch shardings plus `constrain` hints, not
for sharding-in-types.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxcorr.config.fields import Invalid, fail, integer, setting, validate

MESH_AXES = ('data', 'fsdp', 'sequence', 'tensor')
"""Mesh axis order, outermost first: `tensor` innermost (its collectives run
every layer on the fastest links), then `sequence` (K/V gathers, every
layer)."""

LogicalAxes = tuple[str | None, ...]

LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
  # Parameters.
  ('vocab', 'tensor'),
  ('embed', ('fsdp', 'sequence')),
  ('mlp', 'tensor'),
  ('heads', 'tensor'),
  ('kv_heads', 'tensor'),
  ('head_dim', None),
  ('layers', None),  # scan-over-layers stacking axis
  ('expert', 'fsdp'),  # MoE experts: expert parallelism over fsdp
  ('norm', None),
  # Activations. Their feature axes never use `fsdp`: the batch already does.
  ('batch', ('data', 'fsdp')),
  ('seq', 'sequence'),
  ('cache_seq', None),
  ('act_embed', None),
  ('act_heads', 'tensor'),
  ('act_kv_heads', 'tensor'),
  ('act_mlp', 'tensor'),
  ('act_vocab', 'tensor'),
)
"""Logical axis -> mesh axis (or axes, or None = replicated)."""


def _axis(value: Any, path: str) -> int:
  """A mesh axis size: a positive int, or -1 for "all the rest"."""
  is_int = isinstance(value, int) and not isinstance(value, bool)
  if not (is_int and (value == -1 or value >= 1)):
    raise Invalid('a positive int or -1')
  return value


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh axis sizes; at most one may be -1, meaning "all the rest"."""

  data: int = setting(
    1, _axis, 'Pure data parallelism (params replicated along it).'
  )
  fsdp: int = setting(
    -1,
    _axis,
    'Data parallelism with params and optimizer state sharded (ZeRO-3).',
  )
  tensor: int = setting(
    1, _axis, 'Tensor (model) parallelism over heads and the MLP width.'
  )
  # Declared last so the positional MeshConfig(data, fsdp, tensor) keeps
  # its meaning; the mesh itself orders the axes as MESH_AXES.
  sequence: int = setting(
    1,
    integer(1),
    "Context parallelism: each training row's positions split over it "
    '(the row length must divide by it; the rollout engine folds it into '
    'its batch axis).',
  )

  def __post_init__(self):
    path = validate(self)
    sizes = {a: getattr(self, a) for a in MESH_AXES}
    if list(sizes.values()).count(-1) > 1:
      fail(path, sizes, 'at most one axis of size -1')

  @classmethod
  def from_any(cls, config: Any) -> MeshConfig:
    """From a MeshConfig, a mapping or a ConfigDict with the mesh fields."""
    if config is None:
      return cls()
    if isinstance(config, cls):
      return config
    default = cls()
    if isinstance(config, Mapping) or hasattr(config, 'get'):
      values = {a: config.get(a, getattr(default, a)) for a in MESH_AXES}
    else:
      values = {a: getattr(config, a, getattr(default, a)) for a in MESH_AXES}
    return cls(**{a: int(v) for a, v in values.items()})

  def shape(self, num_devices: int) -> tuple[int, ...]:
    """The sizes of `MESH_AXES` on `num_devices` devices."""
    sizes = [getattr(self, a) for a in MESH_AXES]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
      if num_devices % known:
        raise ValueError(f'{num_devices} devices do not divide into {self}')
      sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
      raise ValueError(
        f'{self} needs {math.prod(sizes)} devices, have {num_devices}'
      )
    return tuple(sizes)


def make_mesh(
  config: Any = None, *, devices: Sequence[jax.Device] | None = None
) -> Mesh:
  """A `MESH_AXES` mesh over `devices` (default: all).

  `config` is a `MeshConfig`, or any mapping / ConfigDict with `data`,
  `fsdp`, `tensor`, `sequence`; the default puts every device on `fsdp`.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = MeshConfig.from_any(config).shape(len(devices))
  return jax.make_mesh(
    shape,
    MESH_AXES,
    axis_types=(AxisType.Auto,) * len(MESH_AXES),
    devices=devices,
  )


def engine_mesh(mesh: Mesh) -> Mesh:
  """The rollout engine's mesh on the trainer's devices: `sequence` folded
  into `fsdp`.

  The engine decodes one token per row a step, so there is no row to
  split: its rows go over data x fsdp x sequence instead. The same
  devices in the same order, so a weight sharded over (fsdp, sequence)
  lies on the same device on both meshes."""
  shape = dict(mesh.shape)
  if shape.get('sequence', 1) == 1:
    return mesh
  shape['fsdp'] *= shape['sequence']
  shape['sequence'] = 1
  return Mesh(
    mesh.devices.reshape([shape[a] for a in MESH_AXES]),
    MESH_AXES,
    axis_types=(AxisType.Auto,) * len(MESH_AXES),
  )


# ------------------------------------------------------------------ rules


def logical_to_spec(
  axes: Sequence[str | None],
  *,
  shape: Sequence[int] | None = None,
  mesh: Mesh | jax.sharding.AbstractMesh | None = None,
  rules: Sequence[tuple[str, Any]] = LOGICAL_RULES,
) -> PartitionSpec:
  """The PartitionSpec of an array whose dimensions are named `axes`.

  With `shape` and `mesh` given, a mesh axis that does not divide its
  dimension is dropped (that dimension is replicated over it), as are mesh
  axes the mesh does not have. A mesh axis is used at most once per spec.
  """
  table = dict(rules)
  sizes = dict(mesh.shape) if mesh is not None else None
  used: set[str] = set()
  spec = []
  for i, name in enumerate(axes):
    if name is not None and name not in table:
      raise KeyError(f'logical axis {name!r} has no rule in LOGICAL_RULES')
    target = table.get(name) if name is not None else None
    mesh_axes = (target,) if isinstance(target, str) else tuple(target or ())
    kept = []
    dim = None if shape is None else shape[i]
    for ax in mesh_axes:
      if ax in used or (sizes is not None and ax not in sizes):
        continue
      if ax == 'sequence' and (sizes is None or sizes[ax] == 1):
        continue  # no context parallelism: specs as without the axis
      if sizes is not None and dim is not None:
        n = sizes[ax] * math.prod(sizes[k] for k in kept)
        if dim % n:
          continue
      kept.append(ax)
      used.add(ax)
    spec.append(
      None if not kept else kept[0] if len(kept) == 1 else tuple(kept)
    )
  return PartitionSpec(*spec)


def logical_sharding(
  axes: Sequence[str | None], mesh: Mesh, shape: Sequence[int] | None = None
) -> NamedSharding:
  """`NamedSharding` of an array with logical dimension names `axes`."""
  return NamedSharding(mesh, logical_to_spec(axes, shape=shape, mesh=mesh))


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """Sharding hint on activation `x` under the mesh set by `jax.set_mesh`.

  A no-op outside a mesh context (single device, tests, eager use).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  spec = logical_to_spec(axes, shape=x.shape, mesh=mesh)
  return jax.lax.with_sharding_constraint(x, spec)


# ------------------------------------------------- params / optimizer / batch


def _var_axes(v: nnx.Variable) -> LogicalAxes:
  axes = v.get_metadata().get('logical_axes')
  if axes is None or len(axes) != len(v.shape):
    raise ValueError(
      f'variable of shape {v.shape} has logical_axes={axes!r}; every model '
      'parameter must name one logical axis per dimension'
    )
  return tuple(axes)


def param_shardings(state: Any, mesh: Mesh) -> Any:
  """Shardings for an `nnx.State` (or module) of logically annotated params.

  Returns the same tree with a `NamedSharding` in place of each value, usable
  as `jax.jit(..., out_shardings=...)` or with `jax.device_put`.
  """
  if isinstance(state, nnx.Module):
    state = nnx.state(state, nnx.Param)

  def one(v):
    if isinstance(v, nnx.Variable):
      return v.replace(logical_sharding(_var_axes(v), mesh, v.shape))
    return NamedSharding(mesh, PartitionSpec())

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Batch-major arrays ([B, ...]): rows over `data` x `fsdp`."""
  return logical_sharding(('batch',) + (None,) * (ndim - 1), mesh)


def init_sharded(make_model, mesh: Mesh):
  """Build `make_model()` (an NNX module) with every param born sharded.

  The module is traced abstractly first, so no device ever holds a full
  replica of a param it does not own.
  """
  abstract = nnx.eval_shape(make_model)
  graphdef, abs_state = nnx.split(abstract)
  shardings = param_shardings(abs_state, mesh)

  def init():
    return nnx.state(make_model())

  with jax.set_mesh(mesh):
    state = jax.jit(init, out_shardings=shardings)()
  return nnx.merge(graphdef, state)
