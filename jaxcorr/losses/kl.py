"""KL estimators between two per-token log-probs (docs/math/losses.md §3).

With `d = logp − ref_logp`:

===================  ======================================  ================
estimator (alias)    value                                   d/d logp
===================  ======================================  ================
k1 (kl)              `d`                                     1
abs                  `|d|`                                   sign(d)
k2 (mse)             `½·d²`                                  d
k3 (low_var_kl)      `u = clip(−d, ±20)`;                    `1 − exp(u)`
                     `clip(exp(u) − u − 1, ±10)`             inside clamps
<base>+              value of `<base>`                       d (k2's)
===================  ======================================  ================

The `+` form is straight-through: `b − sg(b) + sg(base)` with `b = ½·d²`, so it
logs the named estimator but differentiates like k2, whose expected pathwise
gradient is the true gradient of KL(π_θ‖π_ref) (k1's is 0 in expectation and
k3's is the gradient of the *forward* KL).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxcorr.losses import masked


def _k1(d: jax.Array) -> jax.Array:
  return d


def _abs(d: jax.Array) -> jax.Array:
  return masked.abs_sign(d)  # gradient sign(d), 0 at d = 0


def _k2(d: jax.Array) -> jax.Array:
  return 0.5 * jnp.square(d)


def _k3(d: jax.Array) -> jax.Array:
  u = jnp.clip(-d, -masked.SAFETY_BOUND, masked.SAFETY_BOUND)
  return jnp.clip(jnp.exp(u) - u - 1, -10.0, 10.0)


ESTIMATORS: dict[str, Callable[[jax.Array], jax.Array]] = {
  'k1': _k1,
  'abs': _abs,
  'k2': _k2,
  'k3': _k3,
}
ALIASES = {'kl': 'k1', 'mse': 'k2', 'low_var_kl': 'k3'}


def valid_names() -> tuple[str, ...]:
  """Every accepted estimator spelling, `+` variants included."""
  base = (*ESTIMATORS, *ALIASES)
  return base + tuple(f'{b}+' for b in base)


def canonical_estimator(name: str, field: str = 'estimator') -> str:
  """`'low_var_kl+'` -> `'k3+'`; ValueError naming the valid spellings."""
  if not isinstance(name, str):
    raise ValueError(
      f'{field}={name!r} is not a KL estimator; allowed: '
      + ', '.join(valid_names())
    )
  base, plus = (name[:-1], '+') if name.endswith('+') else (name, '')
  base = ALIASES.get(base, base)
  if base not in ESTIMATORS:
    raise ValueError(
      f'{field}={name!r} is not a KL estimator; allowed: '
      + ', '.join(valid_names())
    )
  return base + plus


def kl_penalty(
  logp: jax.Array,
  ref_logp: jax.Array,
  estimator: str,
  *,
  mask: jax.Array | None = None,
) -> jax.Array:
  """Elementwise KL estimate between `logp` and the constant `ref_logp`.

  Args:
    logp: `[B, T]` log-probs that carry gradient.
    ref_logp: `[B, T]` reference log-probs; treated as a constant.
    estimator: `k1`, `abs`, `k2`, `k3`, an alias (`kl`, `mse`, `low_var_kl`)
      or any of these with one trailing `+` (value of the estimator, gradient
      of k2).
    mask: optional `[B, T]` bool. With a mask, inputs are sanitised and the
      output is 0 outside it; without one the caller must pass clean inputs.

  Returns:
    `[B, T]` per-token KL values in the computation dtype.
  """
  name = canonical_estimator(estimator)
  masked.check_shapes({'logp': logp, 'ref_logp': ref_logp}, ndim=None)
  dtype = masked.float_dtype(logp, ref_logp)
  ref_logp = jax.lax.stop_gradient(ref_logp)
  if mask is not None:
    masked.check_mask(mask)
    masked.check_shapes({'logp': logp, 'mask': mask}, ndim=None)
    logp = masked.sanitize(logp, mask, dtype)
    ref_logp = masked.sanitize(ref_logp, mask, dtype)
  else:
    logp = masked.as_float(logp, dtype)
    ref_logp = masked.as_float(ref_logp, dtype)
  d = logp - ref_logp
  if name.endswith('+'):
    base = ESTIMATORS[name[:-1]](d)
    pathwise = _k2(d)
    out = pathwise - jax.lax.stop_gradient(pathwise)
    out = out + jax.lax.stop_gradient(base)
  else:
    out = ESTIMATORS[name](d)
  if mask is not None:
    out = jnp.where(mask, out, jnp.zeros((), out.dtype))
  return out
