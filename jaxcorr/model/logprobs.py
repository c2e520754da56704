"""Per-token log-probs (and entropies) without materialising [B, T, V] logits.

Every log-prob in the trainer comes from here: policy, reference and the
decoupled "old" policy alike. For tokens [B, S] the log-prob of token t + 1
given tokens 0..t is

    logp[b, t] = log softmax(logits[b, t] / temperature)[tokens[b, t + 1]]

for t in [0, S - 1), always float32 and never > 0 (`nonpositive`).
The head's product accumulates in float32 whatever the compute dtype
(bf16 x bf16 products are exact in float32: the float32 dot of the same
operands) and the logsumexp runs on those float32 logits (MaxText #5231's
fp32 head). With V ~ 150k a float32 logits tensor is B * S * 600 KB (5 GB
for 8 x 1024 tokens), and autodiff would keep another copy for the
backward pass. `logprobs_from_hidden` instead scans
over chunks of `chunk_size` positions: each chunk projects [B, c, D] hidden
states to [B, c, V] logits, reduces them to log-probs at once, and is wrapped
in `jax.checkpoint`, so the backward pass recomputes one chunk's logits at a
time too. Peak memory is about 3 x B x c x V x 4 bytes instead of
2 x B x S x V x 4 (measured in `bench/model.py`).

Temperature: the rollout engine samples from softmax(logits / T); the
trainer must score with the same T or every importance ratio is off.

Packed rows: the log-prob at the first token of a segment is "predicted"
from the previous segment's last token and means nothing; callers mask it
(with the response mask they already have).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcorr.model.context_parallel import sequence_shards
from jaxcorr.model.layers import matmul_precision
from jaxcorr.model.projection import dense_einsum
from jaxcorr.model.transformer import (
  Transformer,
  entropy_terms,
  mask_padded_vocab,
)
from jaxcorr.sampling import nonpositive
from jaxcorr.sharding import constrain

DEFAULT_CHUNK = 128
# `remat='auto'` keeps each chunk's logits for the backward pass (no second
# head matmul and softmax per position) while one call's [B, T, V] float32
# logits stay within this many bytes; past it, chunks are rematerialised.
# configs/smollm2_arith.py's micro-batch holds 396 MB of logits: keeping
# them makes its update 6-9% faster on the CPU (docs/benchmarks.md, "GPU:
# one NVIDIA H200, second run"), for ~0.8 GB more at the backward's peak.
REMAT_AUTO_BYTES = 512 * 2**20
REMAT_MODES = ('auto', 'always', 'never')


def remat_chunks(mode: str, batch: int, length: int, vocab: int) -> bool:
  """Whether `logprobs_from_hidden` checkpoints its chunks (`mode`: one of
  `REMAT_MODES`; 'auto': only past `REMAT_AUTO_BYTES` of logits)."""
  if mode not in REMAT_MODES:
    raise ValueError(f'remat={mode!r}: expected one of {REMAT_MODES}')
  if mode == 'auto':
    return batch * length * vocab * 4 > REMAT_AUTO_BYTES
  return mode == 'always'


def _temperature(
  temperature: float | jax.Array, batch: int, length: int | None = None
) -> jax.Array:
  """Temperature as [B or 1, 1, 1] float32 (a scalar or one per row), or
  [B, T] (one per position: packed rows hold sequences of several rows)."""
  t = jnp.asarray(temperature, jnp.float32)
  if t.ndim == 0:
    return t.reshape(1, 1, 1)
  if length is not None and t.shape == (batch, length):
    return t
  if t.shape != (batch,):
    raise ValueError(
      f'temperature shape {t.shape}: expected (), ({batch},) or '
      f'({batch}, {length})'
    )
  return t.reshape(batch, 1, 1)


def _chunk_stats(
  hidden: jax.Array,
  targets: jax.Array,
  head: jax.Array,
  temp: jax.Array,
  dtype: jnp.dtype,
  precision: jax.lax.Precision | None,
  with_entropy: bool,
  real_vocab_size: int | None = None,
  kept: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
  """hidden [B, c, D], targets [B, c] -> (logp, entropy | None, log_mass |
  None), each [B, c]; with `kept` = (ids [B, c, C], count [B, c]) the
  log-prob is renormalised over the kept set (`replay_logprobs`)."""
  logits = dense_einsum(
    'bcd,vd->bcv',
    hidden.astype(dtype),
    head.astype(dtype),
    precision,
    preferred_element_type=jnp.float32,
  )
  logits = mask_padded_vocab(logits, real_vocab_size)
  logits = constrain(logits, ('batch', 'seq', 'act_vocab')) / temp
  if with_entropy:
    lse, entropy = lse_and_entropy(logits)
  else:
    lse, entropy = jax.nn.logsumexp(logits, axis=-1), None
  log_mass = None
  if kept is None:
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    logp = nonpositive(picked - lse)  # rounding can exceed 0 by ulps
  else:
    logp, log_mass = replay_logprobs(logits, targets, kept[0], kept[1])
  return logp, entropy, log_mass


def lse_and_entropy(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(logsumexp, entropy of the softmax) over the last axis, from one exp.

  With m = max z, e = exp(z − m) and s = Σ e:

      lse = m + log s,    H = lse − E_p[z] = log s − Σ e·(z − m) / s

  Softmax-then-entropy (p = exp(z − lse), H = lse − Σ p·z) takes a second
  exp over the vocabulary and subtracts two numbers of the logits' size:
  summing e·(z − m) keeps the entropy exact under a common shift of the
  logits. Alone, the head's forward with the entropy is 1.7x faster on the
  CPU (825 -> 480 ms for [32, 64, 49152] logits); inside SmolLM2's update
  XLA already shared the exp (docs/benchmarks.md, "GPU: one NVIDIA H200,
  second run"). Masked columns (z = -inf) have e = 0 and add nothing. m is
  a constant to autodiff (both results are invariant to it), so the
  gradients are the softmax's: ∂lse/∂z = p and ∂H/∂z = −p·(z − E_p[z]).
  """
  m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  shifted = logits - m
  e = jnp.exp(shifted)
  s = jnp.sum(e, axis=-1)
  log_s = jnp.log(s)
  finite = jnp.isfinite(shifted)
  mean_shift = jnp.sum(e * jnp.where(finite, shifted, 0), axis=-1) / s
  return m[..., 0] + log_s, log_s - mean_shift


def chunk_length(t: int, chunk_size: int) -> int:
  """As few chunks as `chunk_size` allows, of equal length: T = 159 with
  chunk_size 128 runs 2 chunks of 80, not 2 of 128 (97 padded positions
  would each cost a [V, D] projection)."""
  n = -(-t // max(1, min(chunk_size, t)))
  return max(1, -(-t // n))


def _to_chunks(x: jax.Array, c: int, p: int = 1, fill=0) -> jax.Array:
  """`[B, T, ...]` -> `[n, B, p·c, ...]`: the scan runs over chunks, each
  chunk keeps the batch axis (and its sharding) intact.

  T is cut into p equal spans (the shards of a row split over the mesh's
  `sequence` axis, T padded to p spans) and chunk i holds positions
  [i·c, (i + 1)·c) of every span, so each device scores its own positions
  with no gather; each span is padded to n·c with `fill`. p = 1: chunk i
  is positions [i·c, (i + 1)·c)."""
  b, t, rest = x.shape[0], x.shape[1], x.shape[2:]
  span = -(-t // p)
  n = -(-span // c)
  pad = ((0, 0),) * len(rest)
  x = jnp.pad(x, ((0, 0), (0, p * span - t), *pad), constant_values=fill)
  x = x.reshape(b, p, span, *rest)
  x = jnp.pad(
    x, ((0, 0), (0, 0), (0, n * c - span), *pad), constant_values=fill
  )
  x = jnp.moveaxis(x.reshape(b, p, n, c, *rest), 2, 0)
  return x.reshape(n, b, p * c, *rest)


def _from_chunks(x: jax.Array, t: int, p: int = 1) -> jax.Array:
  """`[n, B, p·c]` -> `[B, t]`, the inverse of `_to_chunks` (padding cut)."""
  n, b, pc = x.shape
  c = pc // p
  x = jnp.moveaxis(x.reshape(n, b, p, c), 0, 2).reshape(b, p, n * c)
  return x[:, :, : -(-t // p)].reshape(b, -1)[:, :t]


def logprobs_from_hidden(
  hidden: jax.Array,
  head: jax.Array,
  targets: jax.Array,
  *,
  temperature: float | jax.Array = 1.0,
  chunk_size: int = DEFAULT_CHUNK,
  return_entropy: bool = False,
  dtype: jnp.dtype | None = None,
  precision: jax.lax.Precision | None = None,
  real_vocab_size: int | None = None,
  kept_ids: jax.Array | None = None,
  kept_count: jax.Array | None = None,
  return_kept_mass: bool = False,
  remat: str = 'always',
) -> jax.Array | tuple[jax.Array, ...]:
  """log softmax(hidden @ head.T / T) at `targets`, chunked over positions.

  With `kept_ids` / `kept_count` (`logprob_mode='replay'`) the log-prob is
  renormalised over the engine's kept set, chunk by chunk
  (`replay_logprobs`; no [B, T, V] mask is built).

  Args:
    hidden: [B, T, D] final hidden states.
    head: [V, D] output projection.
    targets: [B, T] int token ids to score.
    temperature: scalar, [B] or [B, T] (per position).
    chunk_size: at most this many positions per chunk (equal chunks).
    return_entropy: also return the entropy of softmax(logits / T).
    dtype: matmul input dtype (default: hidden's); accumulation is float32.
    precision: matmul precision (None: backend default).
    real_vocab_size: columns at or past it are padding, set to -inf.
    kept_ids: [B, T, C] int kept ids per position (replay), or None.
    kept_count: [B, T] int number of leading ids that count.
    return_kept_mass: also return log Z_t [B, T] (replay only), last.
    remat: 'always' (the backward pass recomputes each chunk's logits),
      'never' (keeps them: ~B * T * V * 4 bytes) or 'auto' by size
      (`remat_chunks`); the same values and gradients.

  Returns:
    logp [B, T] float32, or (logp, entropy?, log_kept_mass?) as asked.
  """
  b, t, _ = hidden.shape
  replay = kept_ids is not None
  if replay != (kept_count is not None) or (return_kept_mass and not replay):
    raise ValueError('kept_ids, kept_count (and return_kept_mass) go together')
  dtype = dtype or hidden.dtype
  temp = _temperature(temperature, b, t)
  per_position = temp.ndim == 2
  # Rows split over the mesh's `sequence` axis: chunks within each shard.
  p = sequence_shards()
  c = chunk_length(-(-t // p), chunk_size)
  xs = (hidden, targets.astype(jnp.int32))
  if replay:
    xs += (kept_ids.astype(jnp.int32), kept_count.astype(jnp.int32))
  xs = tuple(_to_chunks(x, c, p) for x in xs)
  if per_position:  # chunked with the positions (padding 1: never 1/0)
    xs += (_to_chunks(temp, c, p, fill=1),)

  def chunk(xs_c, head, temp):
    kept = (xs_c[2], xs_c[3]) if replay else None
    return _chunk_stats(
      xs_c[0], xs_c[1], head, temp, dtype, precision, return_entropy,
      real_vocab_size, kept,
    )  # fmt: skip

  # Checkpointed, the backward pass recomputes a chunk's logits instead of
  # the scan saving all n of them (which would be the full [B, T, V] again).
  if remat_chunks(remat, b, t, head.shape[0]):
    chunk = jax.checkpoint(chunk)

  def body(carry, xs_c):
    if per_position:
      return carry, chunk(xs_c[:-1], head, xs_c[-1][..., None])
    return carry, chunk(xs_c, head, temp)

  _, (logp, ent, log_mass) = jax.lax.scan(body, None, xs)
  out = [logp] + [ent] * return_entropy + [log_mass] * return_kept_mass
  out = [_from_chunks(x, t, p) for x in out]
  return out[0] if len(out) == 1 else tuple(out)


def token_logprobs(
  model: Transformer,
  tokens: jax.Array,
  *,
  temperature: float | jax.Array = 1.0,
  positions: jax.Array | None = None,
  segment_ids: jax.Array | None = None,
  return_entropy: bool = False,
  chunk_size: int = DEFAULT_CHUNK,
  remat: str = 'always',
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Log-probs [B, S - 1] float32 of tokens[:, 1:] given their prefixes.

  `positions` / `segment_ids` [B, S] as in `Transformer.hidden_states`
  (packed sequences). With `return_entropy`, also the [B, S - 1] entropy of
  each next-token distribution at the same temperature; `remat` as in
  `logprobs_from_hidden`.
  """
  hidden, _ = model.hidden_states(
    tokens, positions=positions, segment_ids=segment_ids
  )
  cfg = model.config
  return logprobs_from_hidden(
    hidden[:, :-1],
    model.head_weight(),
    tokens[:, 1:],
    temperature=temperature,
    chunk_size=chunk_size,
    return_entropy=return_entropy,
    dtype=cfg.dtype,
    precision=matmul_precision(cfg),
    real_vocab_size=cfg.real_vocab_size,
    remat=remat,
  )


def naive_token_logprobs(
  model: Transformer,
  tokens: jax.Array,
  *,
  temperature: float | jax.Array = 1.0,
  positions: jax.Array | None = None,
  segment_ids: jax.Array | None = None,
  return_entropy: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Reference for `token_logprobs` that materialises the full [B, S, V]
  logits (tests and the memory benchmark)."""
  logits = model(tokens, positions=positions, segment_ids=segment_ids)[:, :-1]
  logits = logits / _temperature(temperature, tokens.shape[0])
  logp_all = jax.nn.log_softmax(logits, axis=-1)
  logp = jnp.take_along_axis(logp_all, tokens[:, 1:, None], axis=-1)[..., 0]
  if not return_entropy:
    return logp
  return logp, -jnp.sum(entropy_terms(jnp.exp(logp_all), logp_all), axis=-1)


# ------------------------------------------------------ sampling-mask replay


def replay_logprobs(
  logits: jax.Array,
  targets: jax.Array,
  kept_ids: jax.Array,
  kept_count: jax.Array,
  *,
  temperature: float | jax.Array = 1.0,
) -> tuple[jax.Array, jax.Array]:
  """Log-probs renormalised over the engine's kept set (`logprob_mode='replay'`).

  With z = logits / τ and K' = {the first `kept_count` entries of
  `kept_ids` that lie in [0, V)} ∪ {y} (duplicates counted once; the
  sampled token is always in, as slime force-keeps it):

      logp[t]      = z[t, y_t] − logsumexp{z[t, v] : v ∈ K'_t}
      log_mass[t]  = logsumexp_{K'_t} z − logsumexp_V z   (log Z_t ≤ 0)

  so `logp_full = logp + log_mass`. The gradient w.r.t. the logits is
  `(onehot(y) − softmax of z over K') / τ`, exactly 0 outside K'; the
  membership itself carries none. Cost O(C) per token on top of the
  vocabulary logsumexp: no `[..., V]` mask is built.

  Args:
    logits: `[..., V]` trainer logits (raw, before temperature).
    targets: `[...]` int sampled tokens y.
    kept_ids: `[..., C]` int kept ids (`rollout.kept_set.KeptSet.ids`).
    kept_count: `[...]` int number of leading entries that count.
    temperature: τ, scalar or broadcastable to `[...]`.

  Returns:
    `(logp, log_mass)`, both `[...]` float32.
  """
  v = logits.shape[-1]
  if kept_ids.shape[:-1] != targets.shape or kept_count.shape != targets.shape:
    raise ValueError(
      f'kept_ids {kept_ids.shape} / kept_count {kept_count.shape} must match '
      f'targets {targets.shape} (+ a trailing C for kept_ids)'
    )
  if logits.shape[:-1] != targets.shape:
    raise ValueError(
      f'logits {logits.shape} must be targets {targets.shape} + [V]'
    )
  temp = jnp.asarray(temperature, jnp.float32)
  z = logits.astype(jnp.float32) / temp[..., None]
  y = targets.astype(jnp.int32)
  z_y = jnp.take_along_axis(z, y[..., None], axis=-1)[..., 0]
  lse_all = jax.nn.logsumexp(z, axis=-1)
  # Sorted ids make duplicates adjacent; invalid entries sort first as -1.
  c = kept_ids.shape[-1]
  ids = kept_ids.astype(jnp.int32)
  live = jnp.arange(c) < kept_count[..., None]
  live &= (ids >= 0) & (ids < v) & (ids != y[..., None])
  ids = jnp.sort(jnp.where(live, ids, -1), axis=-1)
  first = jnp.concatenate(
    [jnp.ones((*ids.shape[:-1], 1), bool), ids[..., 1:] != ids[..., :-1]],
    axis=-1,
  )
  live = (ids >= 0) & first
  z_k = jnp.take_along_axis(z, jnp.clip(ids, 0, v - 1), axis=-1)
  lse_k = jax.nn.logsumexp(
    jnp.concatenate([jnp.where(live, z_k, -jnp.inf), z_y[..., None]], -1),
    axis=-1,
  )
  return nonpositive(z_y - lse_k), nonpositive(lse_k - lse_all)
