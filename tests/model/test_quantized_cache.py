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
  cache = qc.QuantizedKV.zeros((B, K, T, DH), qc.KV_QTYPES[name])
  cache = cache.write(x, jnp.int32(0))
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
  ck = qc.QuantizedKV.zeros(k.shape, jnp.int8).write(k[:, :, :3], index)
  full = ck.dequantize(jnp.float32)
  for r, i in enumerate([2, 5, 0]):
    np.testing.assert_allclose(full[r, :, i : i + 3], k[r, :, :3], atol=0.05)
    assert np.all(np.asarray(full[r, :, :i]) == 0)
  ck = qc.QuantizedKV.zeros(k.shape, jnp.int8).write(k, jnp.int32(0))
  cv = qc.QuantizedKV.zeros(v.shape, jnp.int8).write(v, jnp.int32(0))
  for s in (1, 3):  # decode (one query) and the einsum path
    q = jax.random.normal(key[2], (B, s, H, DH))
    mask = jnp.arange(12)[None, None, :] <= jnp.arange(s)[None, :, None] + 6
    got = qc.attend_quantized(q, ck, cv, mask, 12)
    ref = attend(
      q,
      ck.dequantize(jnp.float32)[:, :, :12],
      cv.dequantize(jnp.float32)[:, :, :12],
      mask,
      heads_first=True,
    )
    np.testing.assert_allclose(got, ref, atol=1e-5)
