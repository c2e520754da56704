"""Loss aggregation (jaxcorr/losses/aggregate.py): mode aliases, errors,
all-masked and padding contracts, micro-batches with global counts, dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.losses import aggregate as agg_lib
from tests.helpers.tolerance import TOL_REORDERED, assert_close


def _rand(shape, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=shape).astype(np.float32)
  lengths = rng.integers(0, shape[1] + 1, size=shape[0])
  lengths[0] = shape[1]
  mask = np.arange(shape[1])[None] < lengths[:, None]
  return x, mask


def test_aliases_equal_canonical():
  x, mask = _rand((5, 7))
  for mode in agg_lib.MODES:
    a = agg_lib.aggregate(x, mask, mode)
    b = agg_lib.aggregate(x, mask, mode.replace('_', '-'))
    assert a == b


def test_unknown_mode_lists_allowed():
  x, mask = _rand((2, 3))
  with pytest.raises(ValueError, match=r"agg='mean'.*seq_mean_token_mean"):
    agg_lib.aggregate(x, mask, 'mean')


def test_trace_time_errors():
  x, mask = _rand((2, 3))
  with pytest.raises(ValueError, match='bool'):
    agg_lib.aggregate(x, mask.astype(np.float32), 'token_mean')
  with pytest.raises(ValueError, match='shape mismatch'):
    agg_lib.aggregate(x, mask[:, :2], 'token_mean')
  with pytest.raises(ValueError, match='norm must be > 0'):
    agg_lib.aggregate(x, mask, 'seq_mean_token_sum_norm', norm=0)


@pytest.mark.parametrize('mode', agg_lib.MODES)
def test_all_masked_is_exact_zero(mode):
  x = jnp.full((3, 4), jnp.nan)
  mask = jnp.zeros((3, 4), bool)
  val, grad = jax.value_and_grad(lambda v: agg_lib.aggregate(v, mask, mode))(x)
  assert val == 0.0
  assert not np.any(np.asarray(grad))


@pytest.mark.parametrize('mode', agg_lib.MODES)
def test_padding_garbage_bitwise(mode):
  x, mask = _rand((6, 9), seed=1)
  dirty = np.where(mask, x, np.float32(np.nan))
  dirty[~mask & (np.arange(9) % 2 == 0)] = np.inf

  def f(v):
    return agg_lib.aggregate(v, mask, mode, norm=16.0)

  v1, g1 = jax.value_and_grad(f)(x)
  v2, g2 = jax.value_and_grad(f)(dirty)
  assert np.asarray(v1).tobytes() == np.asarray(v2).tobytes()
  assert np.asarray(g1).tobytes() == np.asarray(g2).tobytes()


@pytest.mark.parametrize('mode', agg_lib.MODES)
def test_micro_batches_with_global_counts_match_full_batch(mode):
  x, mask = _rand((8, 11), seed=2)
  n_tok = mask.sum()
  n_seq = (mask.sum(-1) > 0).sum()

  def full(v):
    return agg_lib.aggregate(v, mask, mode, norm=11.0)

  def split(v):
    return sum(
      agg_lib.aggregate(
        v[i : i + 2],
        mask[i : i + 2],
        mode,
        num_tokens=n_tok,
        num_seqs=n_seq,
        norm=11.0,
      )
      for i in range(0, 8, 2)
    )

  def terms(v):
    nums, cnts = zip(
      *(
        agg_lib.aggregate_terms(v[i : i + 2], mask[i : i + 2], mode, norm=11.0)
        for i in range(0, 8, 2)
      )
    )
    return agg_lib.finalize(sum(nums), sum(cnts), mode)

  v0, g0 = jax.value_and_grad(full)(x)
  for fn in (split, terms):
    v, g = jax.value_and_grad(fn)(x)
    assert_close(v, v0, TOL_REORDERED)
    assert_close(g, g0, TOL_REORDERED)


def test_bf16_is_upcast_and_f64_kept():
  x, mask = _rand((3, 5))
  out = agg_lib.aggregate(jnp.asarray(x, jnp.bfloat16), mask, 'token_mean')
  assert out.dtype == jnp.float32
  with jax.enable_x64(True):
    out = agg_lib.aggregate(x.astype(np.float64), mask, 'token_mean')
    assert out.dtype == jnp.float64
