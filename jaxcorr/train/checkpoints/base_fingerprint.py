"""The fingerprint of a LoRA run's frozen base weights, stored with every
adapter-only checkpoint so that a resume on another base is refused.

A checkpoint of a LoRA run holds the adapters, their optimizer state and
the rest of the `TrainState`, not the base (jaxcorr/train/checkpoints/
resume.py); the adapters only mean something on the weights they were
trained on. Per base leaf the fingerprint keeps its shape, dtype and three
float64 statistics (sum, sum of squares, and a sum weighted by a fixed
function of the position, which changes when values move around); two
bases match when every leaf's shape and dtype are equal and the statistics
agree to 1e-6 relative (different meshes may sum in another order).

`check_adapters` runs before any array is read: the checkpoint's adapter
layout (whether it holds adapters, their rank and target modules, from its
meta) must be the run's, since adapters of another shape or on other
modules cannot be restored even with `--allow_config_change`. Both errors
are `ConfigChanged` errors: one line at the command line (`jaxcorr.main`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcorr.train.checkpoints.workdir import ConfigChanged


class BaseMismatchError(ConfigChanged):
  """An adapter checkpoint restored onto other base weights."""


class AdapterLayoutError(ConfigChanged):
  """A checkpoint whose adapters (or their absence) the run cannot take."""


def _stats(x: jax.Array) -> jax.Array:
  x = x.astype(jnp.float32).reshape(-1)
  w = jnp.sin(jnp.arange(x.size, dtype=jnp.float32) * 0.618034)
  return jnp.stack([jnp.sum(x), jnp.sum(x * x), jnp.sum(x * w)])


_all_stats = jax.jit(lambda leaves: [_stats(x) for x in leaves])


def fingerprint(frozen: Any) -> dict[str, list]:
  """`{path: [shape, dtype, [sum, sum of squares, weighted sum]]}` of the
  base's leaves (JSON-able: stored in the checkpoint's meta)."""
  flat = nnx.to_flat_state(frozen) if isinstance(frozen, nnx.State) else None
  if flat is None:
    items = jax.tree_util.tree_flatten_with_path(frozen)[0]
    paths = [jax.tree_util.keystr(p) for p, _ in items]
    leaves = [x for _, x in items]
  else:
    paths = ['/'.join(map(str, p)) for p, _ in flat]
    leaves = [v[...] if isinstance(v, nnx.Variable) else v for _, v in flat]
  stats = jax.device_get(_all_stats(leaves))
  return {
    p: [list(x.shape), str(x.dtype), [float(v) for v in s]]
    for p, x, s in zip(paths, leaves, stats)
  }


def check_base(saved: dict, current: dict, source: str) -> None:
  """Raises `BaseMismatchError` naming the first leaf where the base that
  `source` was trained on differs from the current one."""
  if set(saved) != set(current):
    missing = sorted(set(saved) ^ set(current))[:3]
    raise BaseMismatchError(
      f'{source} holds LoRA adapters of another base model: its base has '
      f'other parameters ({", ".join(missing)} ...); resume on the base it '
      'was trained on (config.model)'
    )
  for path in sorted(saved):
    (s_shape, s_dtype, s_stats), (c_shape, c_dtype, c_stats) = (
      saved[path],
      current[path],
    )
    same = s_shape == c_shape and s_dtype == c_dtype
    if same:
      a, b = np.asarray(s_stats), np.asarray(c_stats)
      same = bool(np.all(np.abs(a - b) <= 1e-6 * np.maximum(np.abs(a), 1.0)))
    if not same:
      raise BaseMismatchError(
        f'{source} holds LoRA adapters trained on other base weights: '
        f'{path} differs (shape {s_shape} {s_dtype}, statistics {s_stats} '
        f'saved; {c_shape} {c_dtype}, {c_stats} now). Resume on the base '
        'it was trained on (config.model.hf_path / init_seed)'
      )


def _targets(value: Any) -> tuple[str, ...]:
  """`lora.target_modules` as a config.json holds it (the comma-separated
  command-line form or a list), sorted."""
  if isinstance(value, str):
    value = value.split(',')
  return tuple(sorted(v.strip() for v in value or () if v.strip()))


def check_adapters(meta: dict, lora: Any, source: str, workdir: str) -> None:
  """Raises `AdapterLayoutError` naming the field when checkpoint `meta`
  (from `source`) holds adapters this run's `lora` (a `LoraConfig`) cannot
  restore: a LoRA checkpoint resumed with rank 0, a full one with LoRA on,
  or another rank or set of target modules (module doc)."""
  saved = (meta.get('run_config') or {}).get('lora') or {}
  rank = int(saved.get('rank') or 0)
  adapters = 'base_fingerprint' in meta
  export = (
    'or start a new --workdir (python -m jaxcorr.export '
    f"--workdir={workdir} --out=DIR writes this run's merged policy)"
  )
  if adapters and not lora.enabled:
    raise AdapterLayoutError(
      f'config.lora.rank=0: {source} holds LoRA adapters'
      f'{f" of rank {rank}" if rank else ""}, not every weight, so a full '
      f'fine-tuning run cannot resume it; resume with config.lora.rank='
      f'{rank or "its rank"}, {export}'
    )
  if not adapters and lora.enabled:
    raise AdapterLayoutError(
      f'config.lora.rank={lora.rank}: {source} is not a LoRA checkpoint (it '
      'holds every weight); resume it with config.lora.rank=0'
    )
  if not (adapters and saved):
    return
  if rank != lora.rank:
    raise AdapterLayoutError(
      f'config.lora.rank={lora.rank}: {source} holds adapters of rank '
      f'{rank}, whose A and B cannot be restored at another rank; resume '
      f'with config.lora.rank={rank}, {export}'
    )
  was, now = (
    _targets(saved.get('target_modules')),
    _targets(lora.target_modules),
  )
  if was != now:
    raise AdapterLayoutError(
      f'config.lora.target_modules={",".join(lora.target_modules)}: '
      f'{source} holds adapters on {",".join(was)}; an adapter added or '
      'dropped cannot be restored; resume with config.lora.target_modules='
      f'{",".join(was)}, {export}'
    )
