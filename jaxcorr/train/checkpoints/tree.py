"""The on-disk form of a checkpoint (jaxcorr/train/checkpoints/checkpointer.py): the
state tree with its `nnx.Variable`s replaced by their values, restore
targets (`abstract_like`) and the JSON form of `meta`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def abstract_like(state: Any) -> Any:
  """The restore target of `state`: a `jax.ShapeDtypeStruct` with shape,
  dtype and sharding for every `jax.Array` leaf.

  NumPy arrays and Python scalars are kept as they are (Orbax restores them
  as NumPy arrays and Python scalars); `nnx.Variable` wrappers and their
  metadata are kept around the abstract values.
  """

  def one(x):
    if isinstance(x, jax.Array):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x

  return jax.tree.map(one, state)


def to_pure(tree: Any) -> Any:
  """Every `nnx.Variable` replaced by its value (the on-disk form)."""
  return jax.tree.map(
    lambda x: x.get_value() if _is_variable(x) else x,
    tree,
    is_leaf=_is_variable,
  )


def from_pure(target: Any, values: Any) -> Any:
  """`values` (the pure form of `target`) put back into its Variables."""
  return jax.tree.map(
    lambda t, v: t.replace(v) if _is_variable(t) else v,
    target,
    values,
    is_leaf=_is_variable,
  )


def check_target(abstract_state: Any) -> None:
  """Every abstract array names its sharding (else Orbax guesses one)."""
  flat = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
  for path, leaf in flat:
    if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None:
      raise ValueError(
        f'restore target leaf {jax.tree_util.keystr(path)} is a '
        'ShapeDtypeStruct without a sharding; build the target with '
        'checkpoint.abstract_like(state) or pass sharding=...'
      )


def jsonable(value: Any, where: str) -> Any:
  """`value` with NumPy / JAX scalars and arrays as Python numbers and lists.

  Raises a ValueError naming the offending key path for anything JSON cannot
  hold.
  """
  if value is None or isinstance(value, str | bool | int | float):
    return value
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, jax.Array | np.ndarray):
    return np.asarray(jax.device_get(value)).tolist()
  if isinstance(value, Mapping):
    out = {}
    for k, v in value.items():
      if not isinstance(k, str):
        raise ValueError(
          f'checkpoint meta key {where}[{k!r}] must be a str, got '
          f'{type(k).__name__}'
        )
      out[k] = jsonable(v, f'{where}[{k!r}]')
    return out
  if isinstance(value, list | tuple):
    return [jsonable(v, f'{where}[{i}]') for i, v in enumerate(value)]
  raise ValueError(
    f'checkpoint meta value {where} of type {type(value).__name__} is not '
    'JSON-serialisable (allowed: dict, list, str, int, float, bool, None, '
    'NumPy/JAX scalars and arrays)'
  )
