"""Recursions over time and batch whitening (docs/math/advantages.md §3, §4).

The token-level estimators of `jaxcorr.losses.advantages` live here:

* `gae` (verl): GAE with a critic, whitened;
* `reinforce_plus_plus` (verl): the discounted return, whitened;
* `remax` (verl): the undiscounted return minus a greedy-rollout baseline;

plus their building blocks `whiten` / `masked_var` (verl `masked_whiten`) and
the two reverse scans. Each scan runs `jax.lax.scan(reverse=True)` over the
time axis with one `[B]` carry per recursion. At a masked position (padding on
either side of a left- or right-aligned response, or a tool-output hole
inside it) every carry passes through unchanged and the output is 0, so the
recursion sees a response with its holes cut out: the masked position's
reward and value are never read.

Inputs arrive sanitised (`where(mask, x, 0)`) from `compute_advantages`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcorr.losses import masked

WHITEN_EPS = 1e-8
"""Added to the variance before `rsqrt` (verl `masked_whiten`)."""


def _scaled(x: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(x / s, s)` with `s = masked.range_scale(max |x| over mask)`: moments
  of `x / s` do not overflow, and scale back to those of `x` exactly."""
  s = masked.range_scale(masked.masked_max(jnp.abs(x), mask))
  return x / s, s


def _var(x: jax.Array, mask: jax.Array) -> jax.Array:
  """`Σ (x − mmean(x))²·m / (N − 1)`, 0 when `N < 2`."""
  n = masked.count(mask, x.dtype)
  mu = masked.masked_mean(x, mask)
  sq = masked.masked_sum(jnp.square(x - mu), mask)
  return masked.safe_div(sq, jnp.maximum(n - 1, 0))


def masked_var(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Unbiased variance of `x` over the True entries of `mask`.

  `var = Σ (x − μ)²·m / (N − 1)`, `μ = mmean(x)`, `N = Σ m` (two passes, the
  value of verl's `masked_var(unbiased=True)`); 0 when `N < 2`, where verl
  raises (D12). Taken on `x` divided by a power of two and scaled back
  (`masked.range_scale`), so it overflows only when the variance itself
  does.

  Args:
    x: float array.
    mask: bool array of the same shape.

  Returns:
    A float scalar.
  """
  xs, s = _scaled(masked.as_float(x), mask)
  return _var(xs, mask) * s * s


def whiten(x: jax.Array, mask: jax.Array) -> jax.Array:
  """`whiten(x, m)`: batch whitening over every valid token (verl).

  `out = (x − μ)·rsqrt(var + 1e-8)·m` with `μ = mmean(x)` and the unbiased
  `var` of `masked_var`. With fewer than 2 valid tokens the result is only
  centred, `(x − μ)·m` (0 for a single token, D12); verl raises there.
  Evaluated as `(x/s − μ/s)·rsqrt(var/s² + 1e-8/s²)` with `s` a power of two
  (`masked.range_scale`): the same value, and finite for large finite `x`
  (±1e30 in float32), whose variance overflows.

  Args:
    x: float `[B, T]` (any shape), NaN/inf allowed where `mask` is False.
    mask: bool, same shape.

  Returns:
    Float array of `x`'s shape, exactly 0 where `mask` is False.
  """
  x = masked.sanitize(x, mask)
  n = masked.count(mask, x.dtype)
  xs, s = _scaled(x, mask)
  centred = xs - masked.masked_mean(xs, mask)
  tiny = jnp.finfo(x.dtype).tiny  # eps/s² may underflow to 0
  inv = jax.lax.rsqrt(jnp.maximum(_var(xs, mask) + WHITEN_EPS / s / s, tiny))
  out = jnp.where(n >= 2, centred * inv, centred * s)
  return jnp.where(mask, out, jnp.zeros((), out.dtype))


def _time_major(*arrays: jax.Array) -> tuple[jax.Array, ...]:
  return tuple(jnp.swapaxes(a, 0, 1) for a in arrays)


def discounted_returns(
  rewards: jax.Array, mask: jax.Array, gamma: float | jax.Array
) -> jax.Array:
  """`R_t = r_t + γ·R_{t+1}` over valid tokens only (verl REINFORCE++).

  Backwards over t with carry `R = 0`: at a valid token `R ← r_t + γ·R` and
  `R_t = R`; at a masked token `R_t = 0` and the carry passes through, so a
  hole is skipped as if it were not there (SkyRL and slime multiply by γ
  across it as well).

  Args:
    rewards: float `[B, T]`, 0 outside `mask`.
    mask: bool `[B, T]`.
    gamma: discount γ (Python float or traced scalar).

  Returns:
    Float `[B, T]` returns, 0 outside the mask.
  """
  gamma = jnp.asarray(gamma, rewards.dtype)

  def step(carry, xs):
    r, m = xs
    new = r + gamma * carry
    return jnp.where(m, new, carry), jnp.where(m, new, 0)

  r_tm, m_tm = _time_major(rewards, mask)
  init = jnp.zeros(rewards.shape[:1], rewards.dtype)
  _, out = jax.lax.scan(step, init, (r_tm, m_tm), reverse=True)
  return jnp.swapaxes(out, 0, 1)


def gae_returns(
  rewards: jax.Array,
  values: jax.Array,
  mask: jax.Array,
  gamma: float | jax.Array,
  lam: float | jax.Array,
) -> jax.Array:
  """The masked GAE recursion of verl: `G_t` at valid tokens, 0 elsewhere.

  Backwards over t with carries `nv = 0` (next value) and `g = 0`:
  `δ_t = r_t + γ·nv − v_t`, `g' = δ_t + γλ·g`; at a valid token
  `nv ← v_t`, `g ← g'`, `G_t = g'`; at a masked token both carries pass
  through. SkyRL recurses over every position, which reads the values left
  in the padding after a left-aligned response (D13).

  Args:
    rewards: float `[B, T]`, 0 outside `mask`.
    values: float `[B, T]` critic values, 0 outside `mask`.
    mask: bool `[B, T]`.
    gamma: discount γ.
    lam: GAE λ.

  Returns:
    Float `[B, T]` advantages `G` before whitening, 0 outside the mask.
  """
  gamma = jnp.asarray(gamma, rewards.dtype)
  gl = gamma * jnp.asarray(lam, rewards.dtype)

  def step(carry, xs):
    nv, g = carry
    r, v, m = xs
    g_new = r + gamma * nv - v + gl * g
    carry = (jnp.where(m, v, nv), jnp.where(m, g_new, g))
    return carry, jnp.where(m, g_new, 0)

  r_tm, v_tm, m_tm = _time_major(rewards, values, mask)
  zero = jnp.zeros(rewards.shape[:1], rewards.dtype)
  _, out = jax.lax.scan(step, (zero, zero), (r_tm, v_tm, m_tm), reverse=True)
  return jnp.swapaxes(out, 0, 1)


# ------------------------------------------------------------- estimators


def gae(
  rewards: jax.Array,
  mask: jax.Array,
  *,
  values: jax.Array,
  gamma: float | jax.Array,
  lam: float | jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """`gae` (verl): `A = whiten(G, m)`, `returns = (G + values)·m`."""
  g = gae_returns(rewards, values, mask, gamma, lam)
  returns = jnp.where(mask, g + values, 0)
  return whiten(g, mask), returns


def reinforce_plus_plus(
  rewards: jax.Array, mask: jax.Array, *, gamma: float | jax.Array
) -> tuple[jax.Array, jax.Array]:
  """`reinforce_plus_plus` (verl): `A = whiten(R, m)`, `returns = R`."""
  ret = discounted_returns(rewards, mask, gamma)
  return whiten(ret, mask), ret


def remax(
  rewards: jax.Array, mask: jax.Array, *, reward_baselines: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """`remax` (verl): `A = (R_t − b_i)·m`, `returns = R·m`.

  `R_t = Σ_{t'≥t} r_{t'}·m_{t'}` (undiscounted) and `b_i` the reward of the
  greedy rollout of row i's prompt. Not whitened.
  """
  ret = discounted_returns(rewards, mask, 1.0)
  adv = jnp.where(mask, ret - reward_baselines[:, None], 0)
  return adv, ret
