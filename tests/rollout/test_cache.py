"""The engine's KV cache is written in place: the compiled multi-step decode
(`rollout.decode.decode_chunk`) neither copies a cache array nor keeps a
second one, checked on XLA's own memory analysis, with the stacked-layout
pattern it replaced as the positive control."""

import jax
import jax.numpy as jnp
import pytest

from jaxcorr.rollout.engine import PolicyEngine
from tests.helpers.model_testing import random_model, tiny_config

# A long cache and wide heads (Dh = 32), so one layer's cache outweighs the
# attention scores [N, H, T] and every other temporary.
_N, _T = 3, 2048


@pytest.fixture(scope='module')
def engine():
  return PolicyEngine(
    random_model(tiny_config(num_heads=2, num_kv_heads=2)),
    max_concurrent_decodes=_N,
    max_prefill_length=16,
    max_target_length=_T,
  )


def _memory(engine, attend_len):
  state = engine.init_decode_state()
  compiled = engine.programs.chunk.lower(
    engine.params,
    state,
    engine.stop_array([1]),
    jnp.int32(0),
    num_steps=8,
    attend_len=attend_len,
  ).compile()
  layer_bytes = state.cache.k[0].nbytes
  cache_bytes = 2 * len(state.cache.k) * layer_bytes
  return compiled.memory_analysis(), layer_bytes, cache_bytes


@pytest.mark.parametrize('attend_len', [_T, 256])
def test_decode_chunk_updates_the_cache_in_place(engine, attend_len):
  mem, layer_bytes, cache_bytes = _memory(engine, attend_len)
  # The donated cache comes back in the same buffers ...
  assert mem.alias_size_in_bytes >= cache_bytes
  # ... and no temporary holds even one layer's cache: no copy per step.
  # (A bounded attention window slices only the live prefix.)
  assert mem.temp_size_in_bytes < layer_bytes / 2, (mem, layer_bytes)


def test_stacked_cache_pattern_is_caught():
  """Control: the old layout (stacked [L, ...] cache, sliced per layer and
  re-stacked every step) shows up as a full-cache temporary."""
  layers, shape = 4, (_N, 2, _T, 32)

  def step(cache, new):
    rows = [
      jax.lax.dynamic_update_slice(cache[i], new, (0, 0, 5, 0))
      for i in range(layers)
    ]
    return jnp.stack(rows)

  def loop(cache, new):
    return jax.lax.fori_loop(0, 8, lambda i, c: step(c, new * i), cache)

  cache = jnp.zeros((layers, *shape), jnp.float32)
  new = jnp.ones((_N, 2, 1, 32), jnp.float32)
  compiled = jax.jit(loop, donate_argnums=(0,)).lower(cache, new).compile()
  assert compiled.memory_analysis().temp_size_in_bytes >= cache.nbytes / 2
