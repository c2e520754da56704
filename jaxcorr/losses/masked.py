"""Masked reductions, safe division and input checks shared by every loss.

Every loss in `jaxcorr.losses` follows the same numerical rules
(`docs/math/README.md` §2 and `docs/math/losses.md` §1):

* inputs are *sanitised* before any arithmetic, `where(mask, x, 0)`, so NaN or
  ±inf stored in padding never reaches a value or a gradient ("double where");
* every division is safe: an empty set gives exactly 0 with gradient 0;
* second moments of large finite values are taken on values divided by a
  power of two (`range_scale`), so they do not overflow;
* every `exp` of a log-ratio sees `clip(r, -20, 20)` (the safety bound);
* floats are promoted to at least float32 (bf16 never enters the math; float64
  stays float64 when x64 is on).

The reductions come in three families, named as in
docs/math/correction.md §4.1:

* token-pooled over a `[B, T]` mask: `masked_sum`, `masked_mean` (`mmean`),
  `masked_max`, `masked_min`;
* within a row: `row_count`, `row_sum`, `row_mean` (`rmean`), `row_max`,
  and the pairwise-summed `row_sum_pairwise`, `row_mean_pairwise`;
* over the non-empty rows `V` of a `[B]` vector: `rows_mean` (`vmean`),
  `rows_max`, `rows_min`, `rows_std` (unbiased).

Every reduction returns 0 on an empty set (divergence D14).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

SAFETY_BOUND = 20.0
"""Clamp applied to every log-ratio before `exp` (verl's SAFETY_BOUND)."""


def float_dtype(*arrays: jax.Array | None) -> jnp.dtype:
  """The computation dtype: the inputs' float type, at least float32."""
  present = [a for a in arrays if a is not None]
  if not present:
    return jnp.dtype(jnp.float32)
  return jnp.promote_types(jnp.result_type(*present), jnp.float32)


def as_float(x: jax.Array, dtype: jnp.dtype | None = None) -> jax.Array:
  """`x` as a float array of at least float32 (or exactly `dtype`)."""
  x = jnp.asarray(x)
  return x.astype(dtype if dtype is not None else float_dtype(x))


def sanitize(
  x: jax.Array, mask: jax.Array, dtype: jnp.dtype | None = None
) -> jax.Array:
  """`where(mask, x, 0)` in the computation dtype: the input-side `where`."""
  x = as_float(x, dtype)
  return jnp.where(mask, x, jnp.zeros((), x.dtype))


def safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
  """`num / den`, exactly 0 (value and gradient) wherever `den == 0`."""
  ok = den != 0
  return jnp.where(ok, num / jnp.where(ok, den, 1), 0)


def safe_sqrt(x: jax.Array) -> jax.Array:
  """`sqrt(max(x, 0))` whose gradient is 0, not inf, at 0."""
  ok = x > 0
  return jnp.where(ok, jnp.sqrt(jnp.where(ok, x, 1)), 0)


def range_scale(max_abs: jax.Array) -> jax.Array:
  """The power of two `s ≥ 1` with `max_abs / s < 2` (1 when `max_abs < 2`
  or is not finite).

  Second moments of large finite values overflow (a reward of 1e30 squares
  to inf in float32); the same moments of `x / s` do not. Dividing and
  multiplying by a power of two only moves the exponent, so a statistic
  computed on `x / s` and scaled back by `s` is the one computed on `x`, bit
  for bit, wherever the latter does not overflow (nor reach subnormals), and
  values below 2 take the unscaled path exactly.
  """
  _, e = jnp.frexp(max_abs)  # max_abs = f·2^e with f in [0.5, 1)
  k = jnp.where(jnp.isfinite(max_abs), jnp.maximum(e - 1, 0), 0)
  return jnp.ldexp(jnp.ones((), max_abs.dtype), k)


def abs_sign(d: jax.Array) -> jax.Array:
  """`|d|` whose gradient is `sign(d)`: 0 at d = 0, as torch's `abs`.

  `jnp.abs` differentiates to 1 at 0; the references' `|δ|` terms give 0
  there, which matters when two log-probs agree exactly on a token.
  """
  return d * jax.lax.stop_gradient(jnp.sign(d))


def exp_clamped(r: jax.Array) -> jax.Array:
  """`exp(clip(r, -20, 20))`: the only way a log-ratio is exponentiated."""
  return jnp.exp(jnp.clip(r, -SAFETY_BOUND, SAFETY_BOUND))


# --------------------------------------------------------------- token-pooled


def count(mask: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
  """Number of True entries of `mask`, as a float scalar."""
  return jnp.sum(mask, dtype=dtype)


def masked_sum(x: jax.Array, mask: jax.Array) -> jax.Array:
  """`Σ x·m` over every axis."""
  return jnp.sum(jnp.where(mask, x, jnp.zeros((), x.dtype)))


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """`mmean(x) = Σ x·m / Σ m`, 0 when the mask is empty."""
  x = as_float(x)
  return safe_div(masked_sum(x, mask), count(mask, x.dtype))


def masked_max(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Max of `x` over the mask, 0 when the mask is empty."""
  x = as_float(x)
  m = jnp.max(jnp.where(mask, x, -jnp.inf))
  return jnp.where(jnp.any(mask), m, jnp.zeros((), x.dtype))


def masked_min(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Min of `x` over the mask, 0 when the mask is empty."""
  return -masked_max(-as_float(x), mask)


# ------------------------------------------------------------------ per row


def row_count(mask: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
  """`n_i = Σ_t m`, shape `[B]`."""
  return jnp.sum(mask, axis=-1, dtype=dtype)


def row_sum(x: jax.Array, mask: jax.Array) -> jax.Array:
  """`Σ_t x·m`, shape `[B]`."""
  return jnp.sum(jnp.where(mask, x, jnp.zeros((), x.dtype)), axis=-1)


def row_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """`rmean_i(x) = Σ_t x·m / n_i`, 0 for an empty row, shape `[B]`."""
  x = as_float(x)
  return safe_div(row_sum(x, mask), row_count(mask, x.dtype))


def row_sum_pairwise(x: jax.Array, mask: jax.Array) -> jax.Array:
  """`Σ_t x·m` per row (`[B, T]` → `[B]`) by pairwise (tree) summation.

  Same value as `row_sum`, with O(log T) instead of O(T) rounding growth:
  a sequence log-ratio `S_i` enters `exp`, which turns an absolute error of
  a few ulps into a relative error above 1e-6 (verl sums with torch's
  cascaded reduction, close to exact).
  """
  x = jnp.where(mask, x, jnp.zeros((), x.dtype))
  t = x.shape[-1]
  width = 1 << max(t - 1, 0).bit_length()
  if width != t:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - t)])
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    x = x[..., :half] + x[..., half:]
  return x[..., 0]


def row_mean_pairwise(x: jax.Array, mask: jax.Array, n: jax.Array) -> jax.Array:
  """`rmean_i(x) = Σ_t x·m / n_i` with `row_sum_pairwise`; 0 for empty rows.

  `n` is the `[B]` row length `row_count(mask)`, passed when known.
  """
  return safe_div(row_sum_pairwise(x, mask), n)


def row_max(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Max over each row's valid tokens, 0 for an empty row, shape `[B]`."""
  x = as_float(x)
  m = jnp.max(jnp.where(mask, x, -jnp.inf), axis=-1)
  return jnp.where(jnp.any(mask, axis=-1), m, jnp.zeros((), x.dtype))


# ------------------------------------------------------- over non-empty rows


def rows_mean(y: jax.Array, valid: jax.Array) -> jax.Array:
  """`vmean(y)`: mean of a `[B]` vector over the rows where `valid`."""
  return masked_mean(y, valid)


def rows_max(y: jax.Array, valid: jax.Array) -> jax.Array:
  """`vmax(y)`, 0 when no row is valid."""
  return masked_max(y, valid)


def rows_min(y: jax.Array, valid: jax.Array) -> jax.Array:
  """`vmin(y)`, 0 when no row is valid."""
  return masked_min(y, valid)


def rows_std(y: jax.Array, valid: jax.Array) -> jax.Array:
  """`vstd(y)`: unbiased std over valid rows; 0 when at most one is valid."""
  y = as_float(y)
  n = count(valid, y.dtype)
  mean = rows_mean(y, valid)
  sq = masked_sum(jnp.square(y - mean), valid)
  return safe_sqrt(safe_div(sq, jnp.maximum(n - 1, 0)))


# ------------------------------------------------------------ trace checks


def check_mask(mask: jax.Array, name: str = 'mask') -> None:
  """Raises ValueError unless `mask` is a bool array (checked at trace time)."""
  if mask is None:
    raise ValueError(f'{name} is required (a bool [B, T] array), got None')
  dtype = jnp.asarray(mask).dtype if not hasattr(mask, 'dtype') else mask.dtype
  if dtype != jnp.bool_:
    raise ValueError(
      f'{name} must have dtype bool, got {dtype}; pass mask.astype(bool)'
    )


def check_shapes(
  arrays: Mapping[str, jax.Array | None], *, ndim: int | None = 2
) -> None:
  """Raises ValueError unless every given array has the same shape."""
  shapes = {k: tuple(jnp.shape(v)) for k, v in arrays.items() if v is not None}
  if not shapes:
    return
  first = next(iter(shapes.values()))
  if ndim is not None and len(first) != ndim:
    raise ValueError(
      f'expected {ndim}-d [B, T] arrays, got shapes '
      + ', '.join(f'{k}={s}' for k, s in shapes.items())
    )
  if any(s != first for s in shapes.values()):
    raise ValueError(
      'shape mismatch: ' + ', '.join(f'{k}={s}' for k, s in shapes.items())
    )


def require(value: object, name: str, why: str) -> None:
  """Raises ValueError naming `name` when a required input is None."""
  if value is None:
    raise ValueError(f'{name} is required {why}, got None')
