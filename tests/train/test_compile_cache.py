"""jaxcorr.train.compile_cache: where `train.compile_cache` puts JAX's
persistent cache, and that a cache JAX already has (the suite's own,
tests/conftest.py) is never replaced."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from jaxcorr.train import compile_cache


def test_cache_dir_settings(tmp_path):
  wd = str(tmp_path)
  assert compile_cache.cache_dir('workdir', wd) == os.path.join(
    wd, 'compile_cache'
  )
  assert compile_cache.cache_dir('', wd) is None
  assert compile_cache.cache_dir('~/c', wd) == os.path.expanduser('~/c')


@pytest.fixture
def no_jax_cache():
  """JAX without a cache dir for the test, the suite's restored after."""
  saved = jax.config.jax_compilation_cache_dir
  keys = (
    'jax_persistent_cache_min_compile_time_secs',
    'jax_persistent_cache_min_entry_size_bytes',
  )
  thresholds = {k: getattr(jax.config, k) for k in keys}
  jax.config.update('jax_compilation_cache_dir', None)
  compilation_cache.reset_cache()
  yield
  jax.config.update('jax_compilation_cache_dir', saved)
  for k, v in thresholds.items():
    jax.config.update(k, v)
  compilation_cache.reset_cache()


def test_enable_writes_programs_under_the_workdir(tmp_path, no_jax_cache):
  assert compile_cache.enable('', str(tmp_path)) is None
  assert jax.config.jax_compilation_cache_dir is None
  path = compile_cache.enable('workdir', str(tmp_path))
  assert path == str(tmp_path / 'compile_cache')
  # A small, fast program is stored too (the engine has many).
  x = np.arange(7, dtype=np.float32)
  y = jax.jit(lambda v: jnp.cumsum(v) * 3.0)(x)
  np.testing.assert_array_equal(y, np.cumsum(x) * 3.0)
  assert os.listdir(path)


def test_enable_keeps_a_cache_jax_already_has(tmp_path, no_jax_cache):
  theirs = str(tmp_path / 'theirs')  # JAX_COMPILATION_CACHE_DIR, the suite's
  jax.config.update('jax_compilation_cache_dir', theirs)
  assert compile_cache.enable('workdir', str(tmp_path)) == theirs
  assert jax.config.jax_compilation_cache_dir == theirs
  assert not (tmp_path / 'compile_cache').exists()
