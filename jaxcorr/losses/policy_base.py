"""Shared pieces of the policy losses (docs/math/losses.md §4.1).

`LossInputs` carries the arrays of one `policy_loss` call after the dispatcher
(`jaxcorr.losses.policy`) has checked, promoted and sanitised them: every float
array is `where(mask, x, 0)` in the computation dtype, and everything except
`logp` is wrapped in `stop_gradient`. The per-loss functions of
`policy_ppo` and `policy_pg` therefore never see padding content.

Every per-loss function has the signature

    fn(x: LossInputs, k: Mapping[str, object]) -> (per_token, metrics)

where `k` holds every knob of docs/math/losses.md §4.4 (defaults filled in),
`per_token` is the `[B, T]` loss ℓ *including* the IS weights, and `metrics` is
a dict of scalar arrays under `actor/`. The dispatcher aggregates ℓ.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcorr.losses import masked

Metrics = dict[str, jax.Array]


class LossInputs(NamedTuple):
  """Sanitised inputs of one policy-loss call; all arrays are `[B, T]`.

  Attributes:
    logp: log π_θ, the only array that carries gradient.
    old_logp: log π_old (stop-gradient), None when the loss does not read it.
    rollout_logp: log μ (stop-gradient), None when not given.
    adv: advantages A (stop-gradient).
    w: IS weights (stop-gradient), None for "no weights" (w = 1).
    mask: bool mask m (the corrected mask).
    key: PRNG key (clip_cov only), or None.
    pick: injected clip_cov selection (bool), or None.
  """

  logp: jax.Array
  old_logp: jax.Array | None
  rollout_logp: jax.Array | None
  adv: jax.Array
  w: jax.Array | None
  mask: jax.Array
  key: jax.Array | None = None
  pick: jax.Array | None = None


LossFn = Callable[[LossInputs, Mapping[str, object]], tuple[jax.Array, Metrics]]


def mmean(v: jax.Array, x: LossInputs) -> jax.Array:
  """`mmean(v)`: masked mean over `x.mask` (0 when the mask is empty)."""
  return masked.masked_mean(v.astype(x.logp.dtype), x.mask)


def zero(x: LossInputs) -> jax.Array:
  """A scalar 0 in the computation dtype (for metrics that are always 0)."""
  return jnp.zeros((), x.logp.dtype)


def clamp(r: jax.Array) -> jax.Array:
  """`clip(r, -20, 20)`: the safety bound δ̂ (D11)."""
  return jnp.clip(r, -masked.SAFETY_BOUND, masked.SAFETY_BOUND)


def old_delta(x: LossInputs) -> jax.Array:
  """δ = logp − old_logp (unclamped)."""
  return x.logp - x.old_logp


def weighted(per_token: jax.Array, x: LossInputs) -> jax.Array:
  """`ℓ·w`: IS weights multiply the loss after all clipping (verl)."""
  return per_token if x.w is None else per_token * x.w


def clip_metrics(
  x: LossInputs, delta: jax.Array, clipfrac: jax.Array, lower: jax.Array
) -> Metrics:
  """The default metric triple; `ppo_kl = mmean(−δ̂)`."""
  return {
    'actor/pg_clipfrac': clipfrac,
    'actor/pg_clipfrac_lower': lower,
    'actor/ppo_kl': mmean(-clamp(delta), x),
  }


def rank(score: jax.Array) -> jax.Array:
  """Rank of each entry of `score` in ascending order over every axis.

  Ties keep the flat (row-major) order, so the lower flat index ranks
  first. Returns an int array of the same shape. Explicitly sharded inputs
  are gathered (replicated) before the sort.
  """
  flat = score.reshape(-1)
  sharding = jax.typeof(flat).sharding
  if any(axis is not None for axis in sharding.spec):
    # Explicitly sharded (e.g. rows over a data axis): a sort needs the whole
    # sorting dimension on every device, so gather it first.
    flat = jax.sharding.reshard(flat, NamedSharding(sharding.mesh, P()))
  order = jnp.argsort(flat, stable=True)
  ranks = (
    jnp.zeros(flat.shape, jnp.int32)
    .at[order]
    .set(jnp.arange(flat.size, dtype=jnp.int32))
  )
  return ranks.reshape(score.shape)
