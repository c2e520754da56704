"""Offline continuous batching over the JetStream engine -> `RolloutBatch`.

    queue of requests (prompt i, sample s)
      --prefill_batch--> each waiting prompt once, a first token per sample
      --insert_batch-->  every free slot in one scatter
      --decode_chunk-->  up to `decode_chunk` steps on device (stop tokens
                         and length limits checked there); leaves early
                         when all slots are done or 1/8 of them are free
      --one host read--> tokens, log-probs, finished slots; freed slots
                         are refilled from the queue before the next chunk

JetStream 0.2.2's orchestrator returns text only, so jaxcorr drives the
engine itself and keeps the per-token log-probs its `PolicyEngine` returns.
Request r = (prompt i, sample s) draws with the key
fold_in(fold_in(PRNGKey(seed), first_prompt + i), s): its tokens depend
neither on the slot it lands in nor on the other requests, so any slot count
gives the same batch, and a host sampling its share of a global batch
(`first_prompt` = the global index of its first prompt) draws what one host
sampling the whole batch would. The host syncs once per chunk; a chunk's
tokens all carry the policy version of its dispatch (weights change only
between dispatches).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import jax
import numpy as np

from jaxcorr.rollout.engine import PolicyEngine, SamplingParams
from jaxcorr.rollout.types import FinishReason, RolloutBatch

_MIN_ROWS = 8  # the smallest batch `_shrink` makes


def check_requests(
  engine: PolicyEngine, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> None:
  """Raise ValueError naming the first bad request (before any work)."""
  if max_new_tokens < 1:
    raise ValueError(f'max_new_tokens must be >= 1, got {max_new_tokens}')
  vocab = engine.config.vocab_size
  for i, p in enumerate(prompts):
    n = len(p)
    if n == 0:
      raise ValueError(f'prompt {i} is empty: at least one token is required')
    if n > engine.max_prefill_length:
      raise ValueError(
        f'prompt {i} has {n} tokens > max_prefill_length='
        f'{engine.max_prefill_length}'
      )
    if n + max_new_tokens > engine.max_target_length:
      raise ValueError(
        f'prompt {i}: {n} prompt + {max_new_tokens} new tokens exceed the '
        f'cache (max_target_length={engine.max_target_length})'
      )
    if min(p) < 0 or max(p) >= vocab:
      raise ValueError(f'prompt {i} has token ids outside [0, {vocab})')


class _Request:
  """Host-side record of one request being decoded."""

  def __init__(self, row: int, group: int, sample: int):
    self.row, self.group, self.sample = row, group, sample
    self.tokens: list[int] = []
    self.logp: list[float] = []
    self.logp_truncated: list[float] = []
    self.versions: list[int] = []
    self.kept: list[tuple] = []  # (ids [n, C], count [n], capped [n])
    self.finish = FinishReason.LENGTH

  def add(self, tokens, logp, logp_t, version, kept=None) -> None:
    """Append sampled tokens (host arrays of one length; kept: their
    `KeptSet` or None)."""
    if kept is not None:
      self.kept.append((kept.ids, kept.count, kept.capped))
    self.tokens.extend(np.asarray(tokens).tolist())
    self.logp.extend(np.asarray(logp).tolist())
    self.logp_truncated.extend(np.asarray(logp_t).tolist())
    self.versions.extend([version] * len(tokens))


def _request_keys(seed: int, first_prompt: int, prompts: int, samples: int):
  """[prompts * samples, 2] uint32 on the host: row i * samples + s is
  fold_in(fold_in(PRNGKey(seed), first_prompt + i), s)."""
  fold = jax.vmap(jax.random.fold_in, in_axes=(None, 0))
  groups = fold(jax.random.PRNGKey(seed), first_prompt + np.arange(prompts))
  keys = jax.vmap(fold, in_axes=(0, None))(groups, np.arange(samples))
  return np.asarray(keys).reshape(prompts * samples, 2)


def generate(
  engine: PolicyEngine,
  prompts: Sequence[Sequence[int]],
  *,
  num_samples: int = 1,
  max_new_tokens: int,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
  min_p: float = 0.0,
  stop_token_ids: Sequence[int] = (),
  seed: int = 0,
  first_prompt: int = 0,
) -> RolloutBatch:
  """Sample `num_samples` responses per prompt (token-id lists).

  Returns a host (numpy) `RolloutBatch` of B = len(prompts) * num_samples
  rows, the samples of one prompt adjacent; P = the longest prompt, T =
  max_new_tokens. `top_k=1` is greedy. `first_prompt` offsets the prompt
  index in the sampling keys (module docstring), not the `group_id`s.
  """
  check_requests(engine, prompts, max_new_tokens)
  if num_samples < 1:
    raise ValueError(f'num_samples must be >= 1, got {num_samples}')
  sp = SamplingParams(temperature, top_k, top_p, min_p)
  stop = frozenset(int(t) for t in stop_token_ids)
  stop_arr = engine.stop_array(stop)
  keys = _request_keys(seed, first_prompt, len(prompts), num_samples)
  queue = collections.deque(
    _Request(i * num_samples + s, i, s)
    for i in range(len(prompts))
    for s in range(num_samples)
  )
  n = engine.max_concurrent_decodes
  chunk = engine.decode_chunk_steps
  done: list[_Request] = []
  slots: list[_Request | None] = [None] * n
  state = engine.init_decode_state()
  while queue or any(r is not None for r in slots):
    free = [i for i, r in enumerate(slots) if r is None]
    admitted, first = [], None
    if free and queue:
      reqs = [queue.popleft() for _ in range(min(len(free), len(queue)))]
      admitted = list(zip(free, reqs))
      state, first = _admit(
        engine, state, prompts, admitted, keys, sp, max_new_tokens, stop_arr
      )
      for slot, req in admitted:
        slots[slot] = req
    if not queue:
      state, slots = _shrink(engine, state, slots)
    if queue:  # stop once 1/8 of the slots are free, to refill them
      exit_active = n - max(1, n // 8)
    elif len(slots) // 2 >= _MIN_ROWS:  # stop at half, to shrink the batch
      exit_active = len(slots) // 2
    else:
      exit_active = 0
    version = engine.policy_version
    reach = _reach(slots, prompts, max_new_tokens, chunk)
    state, out = engine.decode_chunk(
      state,
      stop_arr,
      exit_active=exit_active,
      attend_len=engine.attend_bucket(reach),
    )
    out, first = jax.device_get((out, first))  # the one sync per chunk
    for m, (_, req) in enumerate(admitted):
      sl = slice(m, m + 1)
      kept = _rows(first.kept, sl)
      req.add(
        first.token[sl], first.logp[sl], first.logp_truncated[sl], version,
        kept,
      )  # fmt: skip
    for slot, req in enumerate(slots):
      if req is None:
        continue
      k = out.counts[slot]
      kept = _rows(out.kept, (slot, slice(0, k)))
      req.add(
        out.tokens[slot, :k], out.logp[slot, :k],
        out.logp_truncated[slot, :k], version, kept,
      )  # fmt: skip
      if not out.active[slot]:
        if req.tokens[-1] in stop:
          req.finish = FinishReason.STOP
        done.append(req)
        slots[slot] = None
  done.sort(key=lambda r: r.row)
  return _to_batch(engine, prompts, done, max_new_tokens, sp)


def _admit(engine, state, prompts, admitted, keys, sp, limit, stop_arr):
  """Prefill the prompts of the `admitted` (slot, request) pairs once each
  and insert every request into its slot."""
  groups = list(dict.fromkeys(req.group for _, req in admitted))
  where = {g: i for i, g in enumerate(groups)}
  prefix = engine.prefill_batch(
    engine.params,
    [prompts[g] for g in groups],
    [where[req.group] for _, req in admitted],
    keys[[req.row for _, req in admitted]],
    sp,
  )
  state = engine.insert_batch(
    prefix,
    state,
    [slot for slot, _ in admitted],
    [limit] * len(admitted),
    stop_arr,
  )
  return state, prefix


def _shrink(engine, state, slots):
  """Once no request waits, move the live rows into a batch of the next
  power of two (>= _MIN_ROWS) when that halves it at least: a decode step
  costs about its row count, and late in a batch most rows are done."""
  live = [i for i, r in enumerate(slots) if r is not None]
  size = max(_MIN_ROWS, 1 << max(len(live) - 1, 0).bit_length())
  if size > len(slots) // 2:
    return state, slots
  free = [i for i, r in enumerate(slots) if r is None]
  rows = live + free[: size - len(live)]
  return engine.compact(state, rows), [slots[i] for i in rows]


def _reach(slots, prompts, limit, chunk) -> int:
  """Cache slots a live row may touch in the next chunk: prompt + tokens
  so far (the newest has no cache entry yet) + up to `chunk` more."""
  return max(
    len(prompts[r.group]) + min(limit, max(len(r.tokens), 1) + chunk) - 1
    for r in slots
    if r is not None
  )


def _to_batch(engine, prompts, done, t, sp) -> RolloutBatch:
  b = len(done)
  p = max(len(q) for q in prompts)
  prompt_tokens = np.zeros((b, p), np.int32)
  prompt_mask = np.zeros((b, p), bool)
  response = np.zeros((b, t), np.int32)
  mask = np.zeros((b, t), bool)
  logp = np.zeros((b, t), np.float32)
  logp_t = np.zeros((b, t), np.float32)
  version = np.full((b, t), -1, np.int32)
  for r in done:
    q = prompts[r.group]
    prompt_tokens[r.row, p - len(q) :] = q  # left-padded
    prompt_mask[r.row, p - len(q) :] = True
    n = len(r.tokens)
    response[r.row, :n] = r.tokens
    mask[r.row, :n] = True
    logp[r.row, :n] = r.logp
    logp_t[r.row, :n] = r.logp_truncated
    version[r.row, :n] = r.versions
  cfg = engine.config
  return RolloutBatch(
    **_kept_fields(done, b, t, engine.kept_set_capacity),
    prompt_tokens=prompt_tokens,
    prompt_mask=prompt_mask,
    response_tokens=response,
    context_mask=mask.copy(),
    response_mask=mask,
    rollout_logp=logp,
    rollout_logp_truncated=logp_t,
    temperature=np.full((b,), sp.temperature, np.float32),
    top_k=np.full((b,), sp.top_k, np.int32),
    top_p=np.full((b,), sp.top_p, np.float32),
    min_p=np.full((b,), sp.min_p, np.float32),
    policy_version=version,
    finish_reason=np.asarray([r.finish for r in done], np.int8),
    group_id=np.asarray([r.group for r in done], np.int32),
    sample_id=np.asarray([r.sample for r in done], np.int32),
    engine_name='jaxcorr.PolicyEngine/jetstream',
    param_dtype=str(np.dtype(cfg.param_dtype)),
    kv_cache_dtype=str(np.dtype(cfg.dtype)),
  )


def _kept_fields(done, b, t, c) -> dict:
  """The batch's kept-set fields (RolloutBatch), empty when C = 0."""
  if not c:
    return {}
  ids = np.full((b, t, c), -1, np.int32)
  count = np.zeros((b, t), np.int32)
  capped = np.zeros((b, t), bool)
  for r in done:
    n = len(r.tokens)
    ids[r.row, :n] = np.concatenate([k[0] for k in r.kept])
    count[r.row, :n] = np.concatenate([k[1] for k in r.kept])
    capped[r.row, :n] = np.concatenate([k[2] for k in r.kept])
  return {'kept_ids': ids, 'kept_count': count, 'kept_capped': capped}


def _rows(kept, index):
  """`kept[index]` on every field of a host `KeptSet`, or None."""
  return None if kept is None else jax.tree.map(lambda x: x[index], kept)
