"""Exact speculative sampling in the engine's decode chunk (Leviathan et
al. 2023, Chen et al. 2023); docs/speculative.md.

One round of a slot at write index i with last token x0:

    draft      d_1..d_k and their draft distributions q_1..q_k
    verify     one target forward over [x0, d_1, .., d_k] at cache slots
               [i, i + k] -> processed target distributions p_1..p_{k+1}
    accept     d_j while u_j < p_j(d_j) / q_j(d_j), u_j ~ U[0, 1)
    correct    at the first rejection j: y ~ norm(max(0, p_j - q_j));
               all k accepted: the bonus y ~ p_{k+1}

p and q are the PROCESSED distributions (temperature, top-k, top-p, min-p:
`jaxcorr.sampling`), so every emitted token is distributed exactly as the
engine's one-token sampler would draw it, and its reported log-probs
(μ: logp_full, logp_truncated) are the target's, from the verify logits.
Greedy (top_k = 1) makes p a point mass: the emitted ids equal greedy
decoding's.

Drafts:
    ngram    prompt lookup: the k tokens that followed the latest earlier
             occurrence of the row's last n tokens in its own context
             (`DecodeState.history`); q is a point mass, so d_j is kept
             with probability p_j(d_j) and the residual is p_j with d_j
             removed.
    layers   self-speculation: the policy's first L layers, its final
             norm and head, decoding k steps on the first L layers of the
             target's own cache. Those layers' keys/values are the
             target's for the same tokens, so no second cache is needed;
             the verify pass rewrites them (and the other layers).
    model    a separate, smaller checkpoint with the policy's token ids
             (`draft_model.DraftModel`), decoding k steps on its own
             cache (`DecodeState.draft`); fixed across weight syncs.

Rejected positions leave garbage in cache slots past the new index; the
index only advances over accepted tokens, so the next round overwrites
them and nothing attends to them. The cache has k + 1 slots of headroom
past max_target_length (`SpeculativeLayout`) for the verify writes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcorr import sampling
from jaxcorr.model import KVCache
from jaxcorr.rollout import decode, draft_model, layout
from jaxcorr.rollout.speculative_config import SpeculativeConfig
from jaxcorr.rollout.state import (
  Chunk,
  DecodeState,
  SamplingParams,
  pack_sampling,
)

# ------------------------------------------------------------ distributions


def processed_probs(logits, sp):
  """logits [N, S, V], sp [N, 4] -> [N, S, V] the distribution the engine
  samples from: softmax(z / τ) restricted to the kept set, renormalised."""
  n, s, v = logits.shape
  flat = logits.reshape(n * s, v)
  rep = jnp.repeat(sp, s, axis=0)
  temp, top_k, top_p, min_p = (
    rep[:, 0], rep[:, 1].astype(jnp.int32), rep[:, 2], rep[:, 3]
  )  # fmt: skip
  keep = sampling.support(flat, temp, top_k, top_p, min_p)
  q = jax.nn.softmax(sampling.scaled_logits(flat, temp), axis=-1)
  w = jnp.where(keep, q, 0.0)
  w = w / jnp.sum(w, axis=-1, keepdims=True)
  return w.reshape(n, s, v), keep.reshape(n, s, v)


def reported_logprobs(logits, keep, tokens, sp):
  """The target's (logp_full, logp_truncated) [N, S] of tokens [N, S]."""
  n, s, v = logits.shape
  temp = jnp.repeat(sp[:, 0], s)
  full, trunc = sampling.token_logprobs(
    logits.reshape(n * s, v),
    tokens.reshape(-1),
    temp,
    keep.reshape(n * s, v),
  )
  return full.reshape(n, s), trunc.reshape(n, s)


def accept_and_correct(key_u, key_r, drafts, q, p):
  """drafts [N, k], q [N, k, V] or None (a point mass on each draft), p
  [N, k+1, V] -> (tokens [N, k+1]: the accepted drafts then the
  correction or bonus, n [N]: how many tokens are valid, in [1, k+1])."""
  k = drafts.shape[1]
  p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
  if q is None:
    q_d = jnp.ones_like(p_d)
    q_full = jax.nn.one_hot(drafts, p.shape[-1], dtype=p.dtype)
  else:
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    q_full = q
  u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(key_u)
  # u < p/q without a division (q_d > 0: the draft drew d from q).
  ok = u * q_d < p_d
  acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # [N]
  p_j = jnp.take_along_axis(p, acc[:, None, None], axis=1)[:, 0]
  q_pad = jnp.concatenate([q_full, jnp.zeros_like(p[:, :1])], axis=1)
  q_j = jnp.take_along_axis(q_pad, acc[:, None, None], axis=1)[:, 0]
  resid = jnp.maximum(p_j - q_j, 0.0)
  # p_j == q_j leaves no residual (and no rejection is possible there).
  resid = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, resid, p_j)
  y = sampling.draw(key_r, resid)
  pos = jnp.arange(k + 1)[None]
  padded = jnp.concatenate([drafts, drafts[:, :1]], axis=1)
  tokens = jnp.where(pos < acc[:, None], padded, y[:, None])
  return tokens.astype(jnp.int32), acc + 1


# ------------------------------------------------------------------ drafts


def ngram_draft(history, index, last, *, k, n):
  """history [N, T] (slot i < index[n] holds position i's token), index
  [N], last [N] (position index's token) -> drafts [N, k]: the tokens that
  followed the latest earlier occurrence of the row's last n tokens (no
  match: the last token repeated; any proposal keeps sampling exact)."""
  rows, t = history.shape
  hist = history.at[jnp.arange(rows), index].set(last, mode='drop')
  pos = jnp.arange(t)[None]
  match = (pos >= n - 1) & (pos < index[:, None])
  for s in range(n):
    tail = jnp.take_along_axis(hist, jnp.maximum(index - s, 0)[:, None], 1)
    prev = jnp.roll(hist, s, axis=1)
    match &= prev == tail
  end = jnp.max(jnp.where(match, pos, -1), axis=1)  # [N], -1: none
  at = end[:, None] + 1 + jnp.arange(k)[None]
  found = (end[:, None] >= 0) & (at <= index[:, None])
  got = jnp.take_along_axis(hist, jnp.minimum(at, t - 1), axis=1)
  return jnp.where(found, got, last[:, None]).astype(jnp.int32)


def sample_drafts(model, cache, state, keys, *, k, attend_len):
  """k tokens from `model` decoding on `cache` from the slots' last
  tokens, each drawn from its processed distribution -> (drafts [N, k],
  q [N, k, V], the cache with the fed tokens' keys/values written)."""
  tok, drafts, qs = state.tokens, [], []
  for j in range(k):
    hidden, cache = model.hidden_states(
      tok[:, None], cache=cache, attend_len=attend_len
    )
    q, _ = processed_probs(model.logits(hidden), state.sampling)
    key = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, j + 2)
    tok = sampling.draw(key, q[:, 0])
    drafts.append(tok)
    qs.append(q[:, 0])
  return jnp.stack(drafts, 1), jnp.stack(qs, 1), cache


def layers_draft(model, state, keys, *, k, layers, attend_len):
  """Self-speculation: `sample_drafts` of the first `layers` layers +
  head on those layers of the target's cache (which the verify pass
  rewrites) -> (drafts, q, the cache)."""
  cache = state.cache
  # `_cached_layers` zips the layers with the cache: a cache of L layers
  # runs the first L.
  part = KVCache(
    k=cache.k[:layers], v=cache.v[:layers], segment_ids=None, index=cache.index
  )
  drafts, q, part = sample_drafts(
    model, part, state, keys, k=k, attend_len=attend_len
  )
  cache = cache.replace(
    k=part.k + cache.k[layers:], v=part.v + cache.v[layers:]
  )
  return drafts, q, cache


def model_draft(draft, state, keys, *, k, attend_len):
  """A separate draft checkpoint (`draft_model.DraftModel`) on its own
  cache (`DecodeState.draft`, kept at the target's index) -> (drafts, q,
  its cache). A (k+1)-th forward writes d_k's keys/values: when all k are
  accepted the next round starts after d_k and the bonus token."""
  model = nnx.merge(draft.graphdef, draft.params)
  cache = state.draft.replace(index=state.cache.index)
  drafts, q, cache = sample_drafts(
    model, cache, state, keys, k=k, attend_len=attend_len
  )
  _, cache = model.hidden_states(
    drafts[:, -1:], cache=cache, attend_len=attend_len
  )
  return drafts, q, cache


# ------------------------------------------------------------ one round


def spec_round(
  graphdef, params, state, live, room, stop_ids, spec, attend_len, draft
):
  """One speculative round of every slot. live [N]: slots that emit;
  room [N]: most tokens each may still put in this chunk; draft: the
  `DraftModel` of draft='model' (else None). Returns (state,
  tokens [N, k+1], logp [N, k+1], logp_truncated [N, k+1], m [N]: how
  many of them each slot emitted)."""
  model = nnx.merge(graphdef, params)
  k = spec.k
  keys = jax.vmap(jax.random.fold_in)(state.keys, state.steps)
  cache, draft_cache = state.cache, state.draft
  if spec.draft == 'ngram':
    drafts = ngram_draft(
      state.history, cache.index, state.tokens, k=k, n=spec.ngram
    )
    q = None
  elif spec.draft == 'model':
    drafts, q, draft_cache = model_draft(
      draft, state, keys, k=k, attend_len=attend_len
    )
  else:
    drafts, q, cache = layers_draft(
      model, state, keys, k=k, layers=spec.draft_layers, attend_len=attend_len
    )
  fed = jnp.concatenate([state.tokens[:, None], drafts], axis=1)
  hidden, cache = model.hidden_states(
    fed, cache=cache.replace(index=state.cache.index), attend_len=attend_len
  )
  logits = model.logits(hidden)  # [N, k+1, V] float32
  p, keep = processed_probs(logits, state.sampling)
  fold = jax.vmap(jax.random.fold_in, in_axes=(0, None))
  out, valid = accept_and_correct(fold(keys, 0), fold(keys, 1), drafts, q, p)
  lp, lpt = reported_logprobs(logits, keep, out, state.sampling)
  # Cut at the first stop token, the length limit and the chunk's room.
  pos = jnp.arange(k + 1)[None]
  stop = decode._is_stop(out.reshape(-1), stop_ids).reshape(out.shape)
  first_stop = jnp.min(jnp.where(stop, pos, k + 1), axis=1) + 1
  m = jnp.minimum(jnp.minimum(valid, first_stop), state.limit - state.steps)
  m = jnp.where(live, jnp.clip(jnp.minimum(m, room), 0, k + 1), 0)
  index = state.cache.index
  t = state.history.shape[1]
  slot = jnp.where(pos < m[:, None], index[:, None] + pos, t)
  rows = jnp.arange(out.shape[0])[:, None]
  history = state.history.at[rows, slot].set(fed, mode='drop')
  last = jnp.take_along_axis(out, jnp.maximum(m - 1, 0)[:, None], 1)[:, 0]
  if draft_cache is not None:
    draft_cache = draft_cache.replace(index=index + m)
  state = state.replace(
    cache=cache.replace(index=index + m),
    draft=draft_cache,
    tokens=jnp.where(m > 0, last, state.tokens),
    steps=state.steps + m,
    history=history,
  )
  hit = jnp.any(stop & (pos < m[:, None]), axis=1)
  done = (m > 0) & (hit | (state.steps >= state.limit))
  return state.replace(active=state.active & ~done), out, lp, lpt, m


def spec_chunk(
  graphdef,
  params,
  state,
  stop_ids,
  exit_active,
  *,
  num_steps,
  attend_len,
  spec,
  cache_len,
  draft=None,
):
  """`decode.decode_chunk` by speculative rounds: each slot emits up to
  `num_steps` tokens (up to k + 1 per round) into the same `Chunk`;
  `draft`: the `DraftModel` of draft='model' (a jit argument)."""
  n, k = state.tokens.shape[0], spec.k
  attend = min(attend_len + k + 1, cache_len)
  buf = (
    jnp.zeros((n, num_steps), jnp.int32),
    jnp.zeros((n, num_steps), jnp.float32),
    jnp.zeros((n, num_steps), jnp.float32),
  )
  steps0 = state.steps

  def live_of(state):
    return state.active & (state.steps - steps0 < num_steps)

  def cond(carry):
    state, _, r = carry
    busy = jnp.sum(state.active.astype(jnp.int32))
    return (r < num_steps) & (busy > exit_active) & jnp.any(live_of(state))

  def body(carry):
    state, buf, r = carry
    live = live_of(state)
    done = state.steps - steps0
    state, out, lp, lpt, m = spec_round(
      graphdef,
      params,
      state,
      live,
      num_steps - done,
      stop_ids,
      spec,
      attend,
      draft,
    )
    pos = jnp.arange(k + 1)[None]
    col = jnp.where(pos < m[:, None], done[:, None] + pos, num_steps)
    rows = jnp.arange(n)[:, None]
    buf = tuple(
      b.at[rows, col].set(x, mode='drop') for b, x in zip(buf, (out, lp, lpt))
    )
    return state, buf, r + 1

  state, buf, r = jax.lax.while_loop(cond, body, (state, buf, jnp.int32(0)))
  return state, Chunk(
    *buf, counts=state.steps - steps0, active=state.active, steps=r
  )


# ------------------------------------------------------ engine plumbing


def spec_insert(
  prefix, state, slots, limit, stop_ids, draft=None
) -> DecodeState:
  """`decode.insert` plus each request's prompt and first token in the
  slot's token history (the n-gram draft's context) and, with a
  `DraftModel`, the draft's cache of the prompt."""
  history, draft_cache = state.history, state.draft
  new = decode.insert(
    prefix, state.replace(history=None, draft=None), slots, limit, stop_ids
  )
  if draft is not None and prefix.prompt is not None:
    draft_cache = draft_model.prefill(draft, draft_cache, prefix, slots)
  src = prefix.source
  if prefix.prompt is not None:
    prompt = prefix.prompt[src]
    history = history.at[slots, : prompt.shape[1]].set(prompt, mode='drop')
  history = history.at[slots, prefix.cache.index[src]].set(
    prefix.token, mode='drop'
  )
  return new.replace(history=history, draft=draft_cache)


@dataclasses.dataclass(frozen=True)
class SpeculativeLayout(layout.Layout):
  """`Layout` whose empty state has k + 1 cache slots of headroom (the
  verify pass writes k + 1 positions), a token history and, with a draft
  model (`draft_config`), the draft's cache."""

  speculative: SpeculativeConfig = dataclasses.field(
    default_factory=SpeculativeConfig
  )
  draft_config: Any = None

  @property
  def cache_len(self) -> int:
    return self.max_target + self.speculative.k + 1

  def empty_state(self) -> DecodeState:
    state = decode.init_state(
      self.config,
      self.slots,
      self.cache_len,
      pack_sampling(SamplingParams()),
      self.kv_dtype,
    )
    history = jnp.zeros((self.slots, self.cache_len), jnp.int32)
    draft = None
    if self.draft_config is not None:
      draft = draft_model.empty_cache(
        self.draft_config, self.slots, self.cache_len
      )
    return self.replicate(state.replace(history=history, draft=draft))[0]


def with_speculation(
  programs: decode.Programs,
  lay: SpeculativeLayout,
  draft: draft_model.DraftModel | None = None,
):
  """`programs` with the decode chunk and insert replaced by speculative
  ones (same signatures: the batched path and the Decoder are unchanged;
  the draft model's params go in as a jit argument, not a constant)."""
  chunk = functools.partial(
    spec_chunk, programs.graphdef, spec=lay.speculative, cache_len=lay.cache_len
  )
  insert = jax.jit(spec_insert, donate_argnums=(1,))
  chunk = jax.jit(
    chunk, donate_argnums=(1,), static_argnames=('num_steps', 'attend_len')
  )
  if draft is not None:
    insert = functools.partial(insert, draft=draft)
    chunk = functools.partial(chunk, draft=draft)
  return programs._replace(insert=insert, chunk=chunk)
