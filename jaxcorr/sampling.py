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

Every log-prob leaves through `nonpositive` (the engine's here, the
trainer's in jaxcorr/model/logprobs.py): rounding can put log q a few ulps
above 0 (the greedy kept mass log(exp(x)) ≠ x; one fusion dividing by τ
differently from another), and a log-prob > 0 is no probability
(MaxText #5231).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def nonpositive(logp: jax.Array) -> jax.Array:
  """min(logp, 0) with gradient 1 wherever logp ≤ 0 (0 included) and 0
  only where logp > 0; NaN and -inf pass through. `jnp.minimum` would halve
  the gradient at a tie (logp == 0 exactly: a certain token), so this is a
  `where`. The values clamped are rounding (a few ulps), never real mass."""
  return jnp.where(logp > 0, jnp.zeros((), logp.dtype), logp)


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
  full = nonpositive(full)
  if keep is None:
    return full, full
  log_z = jax.nn.logsumexp(jnp.where(keep, full_all, -jnp.inf), axis=-1)
  trunc = jnp.where(
    jnp.take_along_axis(keep, tokens[..., None], axis=-1)[..., 0],
    full - log_z,
    -jnp.inf,
  )
  return full, nonpositive(trunc)


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

  When no row truncates (top_k = 0, top_p = 1, min_p = 0: the RL default)
  the kept set is the whole vocabulary, the two log-probs are equal, and
  one pass of exp(z - max z) into per-block sums gives both the
  normaliser and the draw's first race (`_sample_untruncated`); otherwise
  the softmax probabilities go through `support` first.
  """
  z = scaled_logits(logits, temperature)
  batch = z.shape[:-1]
  truncates = jnp.any(
    (_per_row(top_k, batch, jnp.int32) > 0)
    | (_per_row(top_p, batch, jnp.float32) < 1.0)
    | (_per_row(min_p, batch, jnp.float32) > 0.0)
  )
  return jax.lax.cond(
    truncates,
    lambda: _sample_truncated(keys, z, top_k, top_p, min_p),
    lambda: _sample_untruncated(keys, z),
  )


def _sample_truncated(keys, z, top_k, top_p, min_p):
  """`sample` from scaled logits z [B, V] through the kept set."""
  log_q = jax.nn.log_softmax(z, axis=-1)
  q = jnp.exp(log_q)
  keep = _support_of_probs(q, top_k, top_p, min_p)
  w = jnp.where(keep, q, 0.0)
  tokens = draw_blocks(keys, *_blocks(w, 0.0))
  full = jnp.take_along_axis(log_q, tokens[..., None], axis=-1)[..., 0]
  kept_mass = jnp.sum(w, axis=-1)
  return tokens, nonpositive(full), nonpositive(full - jnp.log(kept_mass))


def _sample_untruncated(keys, z):
  """`sample` from scaled logits z [B, V] over the full vocabulary: log q[y]
  = z[y] - m - log Σ exp(z - m), with the sum taken over the block sums
  the draw races over (no log-softmax, no second pass over V)."""
  m, e, size, block_sums = exp_blocks(z)
  tokens = draw_blocks(keys, e, size, block_sums)
  z_y = jnp.take_along_axis(z, tokens[..., None], axis=-1)[..., 0]
  full = z_y - m[..., 0] - jnp.log(jnp.sum(block_sums, axis=-1))
  full = nonpositive(full)
  return tokens, full, full


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
  return draw_blocks(keys, *_blocks(w, 0.0))


def _blocks(x: jax.Array, pad: float) -> tuple[jax.Array, int]:
  """x [B, V] -> (x padded with `pad` and reshaped [B, V / S, S], S): S the
  power of two nearest above √V."""
  b, v = x.shape
  size = 1 << max(0, math.ceil(math.log2(math.sqrt(v))))
  blocks = -(-v // size)
  x = jnp.pad(x, ((0, 0), (0, blocks * size - v)), constant_values=pad)
  return x.reshape(b, blocks, size), size


def exp_blocks(z: jax.Array) -> tuple[jax.Array, jax.Array, int, jax.Array]:
  """z [B, V] -> (m = max z [B, 1], e = exp(z - m) in blocks [B, V / S, S]
  (`_blocks`), S, the block sums [B, V / S]): one pass giving both the
  normaliser, log Σ exp z = m + log Σ block sums, and what `draw_blocks`
  races over."""
  m = jnp.max(z, axis=-1, keepdims=True)
  e, size = _blocks(jnp.exp(z - m), 0.0)
  return m, e, size, jnp.sum(e, axis=-1)


def draw_blocks(keys, w, size, block_sums=None) -> jax.Array:
  """`draw` on weights already in blocks, w [B, V / S, S]; block_sums
  [B, V / S] when the caller has them. One uniform draw per row gives both
  races' √V-wide noise (one threefry call instead of a split and two)."""
  tiny = jnp.finfo(jnp.float32).tiny
  if block_sums is None:
    block_sums = jnp.sum(w, axis=-1)
  width = max(w.shape[1], size)
  u = jax.vmap(lambda k: jax.random.uniform(k, (2, width), minval=tiny))(keys)

  def race(x, u):
    n = x.shape[-1]
    return jnp.argmax(jnp.where(x > 0, x / -jnp.log(u[:, :n]), -1.0), axis=-1)

  block = race(block_sums, u[:, 0])
  chosen = jnp.take_along_axis(w, block[:, None, None], axis=1)[:, 0]
  return (block * size + race(chosen, u[:, 1])).astype(jnp.int32)
