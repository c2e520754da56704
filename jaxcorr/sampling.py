"""The shared temperature and truncation rule (`docs/math/rollout_contract.md`
§1-§2): one definition for the rollout engine and the trainer.

    q = softmax(z / τ)                       fp32, full vocabulary
    K = support(z, τ, top_k, top_p, min_p)   the kept set
    logp_full      = log q[y]
    logp_truncated = log q[y] - log Σ_{v∈K} q_v   (>= logp_full)

The sampler draws y from q restricted to K and renormalised, so the two
log-probs it reports describe exactly the distribution it sampled. Every
parameter may be a scalar or one value per row (continuous batching mixes
requests with different settings in one decode step). Greedy decoding is
`top_k=1`: the kept set is the argmax (ties to the lower id).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _per_row(x: float | jax.Array, batch_shape: tuple[int, ...], dtype):
  """A scalar or [...] parameter as [..., 1] for broadcasting over V."""
  return jnp.broadcast_to(jnp.asarray(x, dtype), batch_shape)[..., None]


def scaled_logits(logits: jax.Array, temperature: float | jax.Array):
  """logits [..., V] -> logits / τ in float32 (τ scalar or [...])."""
  temp = _per_row(temperature, logits.shape[:-1], jnp.float32)
  return logits.astype(jnp.float32) / temp


def support(
  logits: jax.Array,
  temperature: float | jax.Array = 1.0,
  top_k: int | jax.Array = 0,
  top_p: float | jax.Array = 1.0,
  min_p: float | jax.Array = 0.0,
) -> jax.Array:
  """The kept set K of docs/math/rollout_contract.md §2 as a mask [..., V] bool.

  Args:
    logits: [..., V] raw logits (any float dtype; cast to fp32).
    temperature: τ > 0, scalar or [...].
    top_k: keep the k most probable tokens (0 = off), scalar or [...].
    top_p: nucleus mass over the top-k survivors (1.0 = off).
    min_p: keep tokens with q >= min_p * max q (0.0 = off).
  """
  z = scaled_logits(logits, temperature)
  return _support_of_probs(jax.nn.softmax(z, axis=-1), top_k, top_p, min_p)


def _support_of_probs(q, top_k, top_p, min_p) -> jax.Array:
  """`support` from the probabilities q [..., V] = softmax(z / τ)."""
  batch = q.shape[:-1]
  k = _per_row(top_k, batch, jnp.int32)
  p = _per_row(top_p, batch, jnp.float32)
  # The sort is the expensive part (a [.., V] argsort per row); skip it when
  # no row truncates by rank or mass.
  keep = jax.lax.cond(
    jnp.any((k > 0) | (p < 1.0)),
    _rank_support,
    lambda q, k, p: jnp.ones(q.shape, bool),
    q,
    k,
    p,
  )
  mp = _per_row(min_p, batch, jnp.float32)
  keep &= q >= mp * jnp.max(q, axis=-1, keepdims=True)
  return keep


def _rank_support(q: jax.Array, k: jax.Array, p: jax.Array) -> jax.Array:
  """top-k then top-p on probabilities q [..., V]; k, p [..., 1]."""
  v = q.shape[-1]
  # Stable sort of -q: equal probabilities keep id order (ties to lower id).
  order = jnp.argsort(-q, axis=-1, stable=True)
  q_sorted = jnp.take_along_axis(q, order, axis=-1)
  rank = jnp.arange(v, dtype=jnp.int32)
  keep_sorted = (k <= 0) | (rank < k)
  # top-p over the renormalised top-k survivors; a token is kept while the
  # mass strictly before it is below top_p (the crossing token stays).
  mass = jnp.where(keep_sorted, q_sorted, 0.0)
  mass = mass / jnp.sum(mass, axis=-1, keepdims=True)
  before = jnp.cumsum(mass, axis=-1) - mass
  keep_sorted &= (p >= 1.0) | (before < p)
  keep_sorted |= rank == 0  # at least one token
  # Back to id order: a scatter through the permutation (no second sort).
  flat = order.reshape(-1, v)
  rows = jnp.arange(flat.shape[0])[:, None]
  keep = (
    jnp.zeros(flat.shape, bool).at[rows, flat].set(keep_sorted.reshape(-1, v))
  )
  return keep.reshape(q.shape)


def token_logprobs(
  logits: jax.Array,
  tokens: jax.Array,
  temperature: float | jax.Array,
  keep: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """(logp_full, logp_truncated) [...] float32 of `tokens` [...].

  logits [..., V]; keep [..., V] the kept set (None: no truncation, the two
  values are equal). A token outside `keep` gets logp_truncated = -inf.
  """
  z = scaled_logits(logits, temperature)
  full_all = jax.nn.log_softmax(z, axis=-1)
  full = jnp.take_along_axis(full_all, tokens[..., None], axis=-1)[..., 0]
  if keep is None:
    return full, full
  log_z = jax.nn.logsumexp(jnp.where(keep, full_all, -jnp.inf), axis=-1)
  trunc = jnp.where(
    jnp.take_along_axis(keep, tokens[..., None], axis=-1)[..., 0],
    full - log_z,
    -jnp.inf,
  )
  return full, trunc


def sample(
  keys: jax.Array,
  logits: jax.Array,
  temperature: float | jax.Array = 1.0,
  top_k: int | jax.Array = 0,
  top_p: float | jax.Array = 1.0,
  min_p: float | jax.Array = 0.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Draw one token per row from the truncated, renormalised distribution.

  Args:
    keys: [B] PRNG keys (one per row, so a row's draw does not depend on
      which other rows share the batch), typed or raw uint32 [B, 2].
    logits: [B, V] raw logits.
    temperature, top_k, top_p, min_p: scalars or [B] (see `support`).

  Returns:
    tokens [B] int32, logp_full [B] and logp_truncated [B] float32.
  """
  log_q = jax.nn.log_softmax(scaled_logits(logits, temperature), axis=-1)
  q = jnp.exp(log_q)
  keep = _support_of_probs(q, top_k, top_p, min_p)
  tokens = draw(keys, jnp.where(keep, q, 0.0))
  full = jnp.take_along_axis(log_q, tokens[..., None], axis=-1)[..., 0]
  kept_mass = jnp.sum(jnp.where(keep, q, 0.0), axis=-1)
  return tokens, full, full - jnp.log(kept_mass)


def draw(keys: jax.Array, w: jax.Array) -> jax.Array:
  """keys [B] (typed or raw [B, 2]), weights w [B, V] >= 0 with a positive
  sum per row -> [B] int32: index i with probability w_i / Σ w.

  Two exponential races (the Gumbel-max trick with one log per entry:
  with E ~ Exp(1) independent, argmax_i w_i / E_i is i with probability
  w_i / Σ w): first over the sums of blocks of S ≈ √V consecutive entries,
  then over the S entries of the chosen block. The draw is exact, since
  P(i) = P(block) · P(i | block), and takes 2√V exponentials per row
  instead of V: the random bits dominated a decode step's sampling. Entries
  of weight 0 never win (they score -1).
  """
  b, v = w.shape
  size = 1 << max(0, math.ceil(math.log2(math.sqrt(v))))
  blocks = -(-v // size)
  w = jnp.pad(w, ((0, 0), (0, blocks * size - v))).reshape(b, blocks, size)
  outer, inner = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
  tiny = jnp.finfo(jnp.float32).tiny

  def race(keys, x):
    u = jax.vmap(lambda k: jax.random.uniform(k, x.shape[-1:], minval=tiny))(
      keys
    )
    return jnp.argmax(jnp.where(x > 0, x / -jnp.log(u), -1.0), axis=-1)

  block = race(outer, jnp.sum(w, axis=-1))
  chosen = jnp.take_along_axis(w, block[:, None, None], axis=1)[:, 0]
  return (block * size + race(inner, chosen)).astype(jnp.int32)
