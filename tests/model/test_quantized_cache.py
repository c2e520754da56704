"""The narrow KV cache (`jaxcorr.model.quantized_cache`): round trip error
per dtype, per-row writes, and attention over the narrow cache == attention
over its dequantized copy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.model import quantized_cache as qc
from jaxcorr.model.layers import attend

B, K, T, DH, H = 3, 2, 16, 8, 4


@pytest.mark.parametrize(
  ('name', 'bound'), [('int8', 0.5 / 127), ('fp8', 2.0**-4)]
)
def test_round_trip(name, bound):
  x = jax.random.normal(jax.random.PRNGKey(0), (B, K, T, DH)) * 3
  dtype = qc.KV_QTYPES[name]
  cache = jax.jit(
    lambda a: qc.QuantizedKV.zeros(a.shape, dtype).write(a, jnp.int32(0))
  )(x)
  assert cache.values.dtype == qc.KV_QTYPES[name]
  assert cache.scale.shape == (B, K, T)
  err = np.abs(np.asarray(cache.dequantize(jnp.float32) - x))
  amax = np.abs(np.asarray(x)).max(-1, keepdims=True)
  assert np.all(err <= bound * amax + 1e-7) and err.max() > 0


def test_per_row_write_and_attention_reads_the_narrow_values():
  key = jax.random.split(jax.random.PRNGKey(1), 4)
  k = jax.random.normal(key[0], (B, K, T, DH))
  v = jax.random.normal(key[1], (B, K, T, DH))
  index = jnp.array([2, 5, 0], jnp.int32)

  @jax.jit
  def fill(x, i):
    return qc.QuantizedKV.zeros((B, K, T, DH), jnp.int8).write(x, i)

  full = np.asarray(fill(k[:, :, :3], index).dequantize(jnp.float32))
  for r, i in enumerate([2, 5, 0]):
    np.testing.assert_allclose(full[r, :, i : i + 3], k[r, :, :3], atol=0.05)
    assert np.all(full[r, :, :i] == 0)
  ck, cv = fill(k, jnp.int32(0)), fill(v, jnp.int32(0))

  @jax.jit
  def both(q, mask):
    got = qc.attend_quantized(q, ck, cv, mask, 12)
    deq = [c.dequantize(jnp.float32)[:, :, :12] for c in (ck, cv)]
    return got, attend(q, *deq, mask, heads_first=True)

  for s in (1, 3):  # decode (one query) and the einsum path
    q = jax.random.normal(key[2], (B, s, H, DH))
    mask = jnp.arange(12)[None, None, :] <= jnp.arange(s)[None, :, None] + 6
    got, ref = both(q, mask)
    np.testing.assert_allclose(got, ref, atol=1e-5)
