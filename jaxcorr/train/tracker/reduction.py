"""How a metric combines across micro-batches and processes: one rule set.

A metric computed on a part of the rows (one micro-batch of a mini-batch,
one process's share of a batch) carries its reduction in a `Metric`:

    SUM   counts and globally normalised loss terms: the parts add up
    MEAN  means and fractions over equal parts: the parts are averaged
    MAX   an extreme: the largest part
    MIN   an extreme: the smallest part
    STD   a standard deviation around its own `mean`: the parts' variances
          are pooled around the mean of the whole (equal parts)
    WMEAN a mean over a count that differs between parts (tokens, rows of
          a kind): the parts' values weighted by their `weight`, the count

Metrics built in `jaxcorr/train/` are made with their kind (`Metric.sum`,
...). The pure losses (`jaxcorr/losses/`) return plain dicts of scalars;
`from_loss` types them at that one boundary: the keys given as `summed`
add up, and a loss names its extremes `…max` / `…min`. Micro-batches
(`reduce_parts`, jitted) and processes (`combine_processes`, numpy) apply
the same kinds, so a metric reduces the same way wherever it is reduced.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


class Reduce(enum.Enum):
  SUM = 'sum'
  MEAN = 'mean'
  MAX = 'max'
  MIN = 'min'
  STD = 'std'
  WMEAN = 'wmean'


@flax.struct.dataclass
class Metric:
  """A scalar metric and how its parts combine (module docstring).

  Attributes:
    value: `[]` (or `[n]`: the values of n parts, stacked by a scan).
    reduce: its `Reduce` kind (static: part of the pytree structure).
    mean: STD only: the mean the deviation is taken around, `[]` or `[n]`.
    weight: WMEAN only: the count the value is a mean over, `[]` or `[n]`.
  """

  value: Any
  reduce: Reduce = flax.struct.field(pytree_node=False, default=Reduce.MEAN)
  mean: Any = None
  weight: Any = None

  @classmethod
  def sum(cls, value: Any) -> Metric:
    return cls(value, Reduce.SUM)

  @classmethod
  def avg(cls, value: Any) -> Metric:
    return cls(value, Reduce.MEAN)

  @classmethod
  def max(cls, value: Any) -> Metric:
    return cls(value, Reduce.MAX)

  @classmethod
  def min(cls, value: Any) -> Metric:
    return cls(value, Reduce.MIN)

  @classmethod
  def std(cls, value: Any, mean: Any) -> Metric:
    return cls(value, Reduce.STD, mean)

  @classmethod
  def wavg(cls, value: Any, weight: Any) -> Metric:
    return cls(value, Reduce.WMEAN, weight=weight)


Metrics = dict[str, Metric]


def from_loss(
  metrics: Mapping[str, Any], *, summed: Iterable[str] = ()
) -> Metrics:
  """Type the plain metric dict of a pure loss (module docstring)."""
  summed = frozenset(summed)
  out = {}
  for key, value in metrics.items():
    if key in summed:
      out[key] = Metric.sum(value)
    elif key.endswith('max'):
      out[key] = Metric.max(value)
    elif key.endswith('min'):
      out[key] = Metric.min(value)
    else:
      out[key] = Metric.avg(value)
  return out


def values(metrics: Mapping[str, Metric]) -> dict[str, Any]:
  """The plain values, in the same order."""
  return {k: m.value for k, m in metrics.items()}


def _pooled_std(std: Any, mean: Any, xp: Any) -> Any:
  """Equal parts: Var = E[std² + mean²] − E[mean]²."""
  var = xp.mean(std**2 + mean**2) - xp.mean(mean) ** 2
  return xp.sqrt(xp.maximum(var, 0.0))


def _reduce(m: Metric, xp: Any) -> Any:
  x = m.value
  if m.reduce is Reduce.SUM:
    return xp.sum(x)
  if m.reduce is Reduce.MAX:
    return xp.max(x)
  if m.reduce is Reduce.MIN:
    return xp.min(x)
  if m.reduce is Reduce.STD:
    return _pooled_std(x, m.mean, xp)
  if m.reduce is Reduce.WMEAN:
    return _weighted_mean(x, m.weight, xp)
  return xp.mean(x)


def _weighted_mean(x: Any, weight: Any, xp: Any) -> Any:
  """Σ x·w / Σ w; the plain mean when every weight is 0 (every part
  empty, so every value is the empty value)."""
  total = xp.sum(weight)
  ok = total > 0
  return xp.where(ok, xp.sum(x * weight) / xp.where(ok, total, 1.0), xp.mean(x))


def reduce_parts(metrics: Mapping[str, Metric]) -> Metrics:
  """`[n]` stacked parts (a scan over micro-batches) -> one `[]` metric
  each, of the same kind (jit-friendly)."""
  out = {}
  for key, m in metrics.items():
    mean = None if m.mean is None else jnp.mean(m.mean)
    weight = None if m.weight is None else jnp.sum(m.weight)
    out[key] = Metric(_reduce(m, jnp), m.reduce, mean, weight)
  return out


def combine_processes(
  per_process: Sequence[Mapping[str, Metric]],
) -> dict[str, float]:
  """One process's view of host metrics that every process computed on an
  equal share of the rows: what one process computing them on all rows
  would log. Every mapping has the same keys and kinds."""
  first = per_process[0]
  out = {}
  for key, m in first.items():
    x = np.asarray([p[key].value for p in per_process], np.float64)
    mean = weight = None
    if m.reduce is Reduce.STD:
      mean = np.asarray([p[key].mean for p in per_process], np.float64)
    if m.reduce is Reduce.WMEAN:
      weight = np.asarray([p[key].weight for p in per_process], np.float64)
    out[key] = float(_reduce(Metric(x, m.reduce, mean, weight), np))
  return out


def gather_processes(metrics: Mapping[str, Metric]) -> dict[str, float]:
  """Host metrics of this process's rows -> those of all rows
  (`combine_processes`); plain values for one process. A collective: every
  process calls it with the same keys, in any order."""
  count = jax.process_count()
  if count == 1 or not metrics:
    return values(metrics)
  from jax.experimental import multihost_utils

  keys = sorted(metrics)
  row = [float(metrics[k].value) for k in keys]
  row += [float(metrics[k].mean or 0.0) for k in keys]
  row += [float(metrics[k].weight or 0.0) for k in keys]
  # Gathered as raw bits: a float64 array would pass through JAX as
  # float32 (x64 is off).
  bits = np.asarray(row, np.float64).view(np.uint32)
  allv = np.asarray(multihost_utils.process_allgather(bits))
  allv = allv.reshape(count, -1).view(np.float64)
  n = len(keys)
  per = [
    {
      k: Metric(v[i], metrics[k].reduce, v[n + i], v[2 * n + i])
      for i, k in enumerate(keys)
    }
    for v in allv
  ]
  combined = combine_processes(per)
  return {k: combined[k] for k in metrics}  # the order one process logs
