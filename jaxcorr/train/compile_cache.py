"""JAX's persistent compilation cache for a run (`train.compile_cache`).

A restarted or repeated run loads the programs an earlier one compiled
(the trainer's steps, the engine's prefill and decode buckets) instead of
compiling them again; a cache hit is the executable XLA built for the same
program, so results are the same bit for bit. Every program is stored,
whatever its compile time: the engine compiles many small programs whose
sum is what start-up waits for.

    'workdir'   <workdir>/compile_cache (the default: a restarted run,
                and nothing written outside the run's own directory)
    a path      a cache shared by runs (e.g. ~/.cache/jaxcorr/jax), also
                on GCS (gs://...)
    ''          off

A cache directory JAX was already given (`JAX_COMPILATION_CACHE_DIR`, or
the test suite's temporary one, tests/conftest.py) is left as it is.
"""

from __future__ import annotations

import os

import jax
from etils import epath
from jax.experimental.compilation_cache import compilation_cache

WORKDIR = 'workdir'
SUBDIR = 'compile_cache'


def cache_dir(setting: str, workdir: str) -> str | None:
  """The directory `train.compile_cache` names (None: off)."""
  if not setting:
    return None
  if setting == WORKDIR:
    return os.path.join(workdir, SUBDIR)
  return os.path.expanduser(setting)


def enable(setting: str, workdir: str) -> str | None:
  """Point JAX's persistent cache at `cache_dir(setting, workdir)` unless
  JAX already has one; returns the directory in use (None: none)."""
  current = jax.config.jax_compilation_cache_dir
  if current:
    return current
  path = cache_dir(setting, workdir)
  if path is None:
    return None
  epath.Path(path).mkdir(parents=True, exist_ok=True)
  jax.config.update('jax_compilation_cache_dir', path)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  # JAX decides "cache or not" at its first compile: start afresh.
  compilation_cache.reset_cache()
  return path
