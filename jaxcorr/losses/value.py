"""The clipped critic loss (docs/math/losses.md §7, verl).

With ε = `cliprange_value`, V the predicted values, V_old the values of the
rollout-time critic and R the returns::

  v̂    = clip(V, V_old − ε, V_old + ε)
  ℓ    = max((V − R)², (v̂ − R)²)
  loss = ½·aggregate(ℓ, mask, agg)

The mask is the response mask *before* rejection (D15): rejection removes
samples from the actor's update, not from the critic's regression target.

Parity: verl is the default (`agg='token_mean'`, ε = 0.5). SkyRL's
`ppo_critic_loss` is `agg='seq_mean_token_mean'` with ε = 0.2. slime omits
the ½, so its value is twice jaxcorr's. `cliprange_value=inf` switches the
clip off (SkyRL's `value_clip=None`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcorr.config import fields
from jaxcorr.losses import aggregate as agg_lib
from jaxcorr.losses import masked


def _check_cliprange(eps: float) -> None:
  if not fields.is_number(eps) or not eps > 0:
    raise ValueError(
      f'cliprange_value={eps!r} is invalid; allowed: a number > 0 '
      '(inf disables the clip)'
    )


def value_loss(
  values: jax.Array,
  old_values: jax.Array,
  returns: jax.Array,
  mask: jax.Array,
  *,
  cliprange_value: float = 0.5,
  agg: str = 'token_mean',
  num_tokens: float | jax.Array | None = None,
  num_seqs: float | jax.Array | None = None,
  norm: float | jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped value loss.

  Args:
    values: `[B, T]` predictions of the critic being trained (gradient).
    old_values: `[B, T]` predictions recorded with the batch (constant).
    returns: `[B, T]` regression targets (constant).
    mask: `[B, T]` bool response mask before rejection (D15).
    cliprange_value: ε > 0, the half-width of the trust region around
      `old_values`.
    agg: aggregation mode or verl alias.
    num_tokens, num_seqs, norm: global normalisers, as in `aggregate`.

  Returns:
    `(loss, metrics)` with `critic/vf_loss`, `critic/vf_clipfrac` (fraction
    of tokens where the clipped branch is the larger) and `critic/vpred_mean`.
  """
  _check_cliprange(cliprange_value)
  agg = agg_lib.canonical_mode(agg, 'agg')
  masked.check_mask(mask)
  masked.check_shapes(
    {
      'values': values,
      'old_values': old_values,
      'returns': returns,
      'mask': mask,
    }
  )
  dtype = masked.float_dtype(values, old_values, returns)
  v = masked.sanitize(values, mask, dtype)
  v_old = masked.sanitize(jax.lax.stop_gradient(old_values), mask, dtype)
  ret = masked.sanitize(jax.lax.stop_gradient(returns), mask, dtype)
  v_clip = jnp.clip(v, v_old - cliprange_value, v_old + cliprange_value)
  unclipped = jnp.square(v - ret)
  clipped = jnp.square(v_clip - ret)
  per_token = jnp.maximum(unclipped, clipped)
  loss = 0.5 * agg_lib.aggregate(
    per_token, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, norm=norm
  )
  metrics = {
    'critic/vf_loss': loss,
    'critic/vf_clipfrac': masked.masked_mean(clipped > unclipped, mask),
    'critic/vpred_mean': masked.masked_mean(jax.lax.stop_gradient(v), mask),
  }
  return loss, metrics
