"""Continuous batching over one `PolicyEngine`, one decode chunk at a time.

    submit(request)    a (prompt, key) waits for a free slot
    advance()          admit waiting requests into free slots (one shared
                       prefill per prompt), maybe shrink the batch, decode
                       one chunk (`PolicyEngine.decode_chunk`), read it back
                       once; returns the requests that finished
    swap(params, v)    new weights between two chunks, in flight: live
                       rows keep their slots and go on under version v

`driver.generate` submits a fixed batch and advances until it is done; the
streaming producer (jaxcorr/train/rollouts/stream.py) keeps submitting and
swaps weights while rows are in flight. Every token records the policy
version whose weights sampled it and its log-probs under them: a chunk runs
entirely under the weights of its dispatch, and weights change only in
`swap`, on the thread that advances.

After a swap a live row's cache still holds keys and values its older
weights computed. `swap(..., recompute=False)` keeps them (PipelineRL: the
new weights attend to stale keys, and the recorded log-probs are what the
engine really sampled from); `recompute=True` first recomputes every live
row's cache under the new weights (one forward over prompt + tokens so
far), so tokens after the swap are exactly the new policy's
(docs/async.md).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxcorr.rollout.engine import PolicyEngine
from jaxcorr.rollout.state import SamplingParams
from jaxcorr.rollout.types import FinishReason

_MIN_ROWS = 8  # the smallest batch `_shrink` makes


class Request:
  """Host-side record of one request: its prompt, key and what it sampled.

  Attributes:
    row, group, sample: where it lands in its batch (`RolloutBatch` row,
      `group_id`, `sample_id`).
    prompt: the prompt's token ids; requests of one prompt share the list
      object, which is what lets them share one prefill.
    key: uint32 [2] sampling key.
    tag: the caller's label (the stream's draw index).
  """

  def __init__(
    self,
    row: int,
    group: int,
    sample: int,
    prompt: Sequence[int],
    key: np.ndarray,
    tag: Any = None,
  ):
    self.row, self.group, self.sample = row, group, sample
    self.prompt, self.key, self.tag = prompt, key, tag
    self.tokens: list[int] = []
    self.logp: list[float] = []
    self.logp_truncated: list[float] = []
    self.versions: list[int] = []
    self.kept: list[tuple] = []  # (ids [n, C], count [n], capped [n])
    # MoE policies: the prompt's experts [len(prompt), L_moe, k], then the
    # experts of each fed response token (all but the newest).
    self.prompt_routing: np.ndarray | None = None
    self.routing: list[np.ndarray] = []
    self.finish = FinishReason.LENGTH

  def add(self, tokens, logp, logp_t, version, kept=None, routing=None):
    """Append sampled tokens (host arrays of one length; kept: their
    `KeptSet` or None; routing: the experts of the tokens the same steps
    fed, [n, L_moe, k], or None)."""
    if routing is not None:
      self.routing.append(routing)
    if kept is not None:
      self.kept.append((kept.ids, kept.count, kept.capped))
    self.tokens.extend(np.asarray(tokens).tolist())
    self.logp.extend(np.asarray(logp).tolist())
    self.logp_truncated.extend(np.asarray(logp_t).tolist())
    self.versions.extend([version] * len(tokens))

  def context(self) -> list[int]:
    """What the cache holds: the prompt and every token but the newest."""
    return list(self.prompt) + self.tokens[:-1]


class Decoder:
  """Requests in, finished requests out (module docstring).

  Args:
    engine: the engine; the decoder owns its decode state.
    sp: sampling parameters of every request.
    max_new_tokens: each request's token budget.
    stop_token_ids: tokens that finish a request.
  """

  def __init__(
    self,
    engine: PolicyEngine,
    *,
    sp: SamplingParams,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
  ):
    self.engine, self.sp, self.limit = engine, sp, max_new_tokens
    self.stop = frozenset(int(t) for t in stop_token_ids)
    self.stop_arr = engine.stop_array(self.stop)
    self.waiting: collections.deque[Request] = collections.deque()
    self.slots: list[Request | None] = [None] * engine.max_concurrent_decodes
    self.state = engine.init_decode_state()

  @property
  def busy(self) -> bool:
    return bool(self.waiting) or any(r is not None for r in self.slots)

  def submit(self, request: Request) -> None:
    self.waiting.append(request)

  def swap(self, params: Any, version: int, *, recompute: bool) -> None:
    """Take the weights of policy `version` before the next chunk; with
    `recompute`, the live rows' caches are recomputed under them."""
    self.engine.update_params(params, version=version)
    if recompute and any(r is not None for r in self.slots):
      contexts = [None if r is None else r.context() for r in self.slots]
      self.state = self.engine.refresh_cache(self.state, contexts)

  def advance(self, *, final: bool = False) -> list[Request]:
    """Admit, decode one chunk, return the requests that finished in it.
    `final`: nothing more will be submitted, so the batch may shrink once
    no request waits (`_shrink`)."""
    engine = self.engine
    admitted, first = self._admit()
    if not any(r is not None for r in self.slots):
      return []
    if final and not self.waiting:
      self._shrink()
    n = len(self.slots)
    if self.waiting:  # stop once 1/8 of the slots are free, to refill them
      exit_active = n - max(1, n // 8)
    elif final and n // 2 >= _MIN_ROWS:  # stop at half, to shrink
      exit_active = n // 2
    else:
      exit_active = 0
    version = engine.policy_version
    self.state, out = engine.decode_chunk(
      self.state,
      self.stop_arr,
      exit_active=exit_active,
      attend_len=engine.layout.attend_bucket(self._reach()),
    )
    out, first = jax.device_get((out, first))  # the one sync per chunk
    for m, (_, req) in enumerate(admitted):
      sl = slice(m, m + 1)
      if first.routing is not None:
        req.prompt_routing = first.routing[m, : len(req.prompt)]
      req.add(
        first.token[sl], first.logp[sl], first.logp_truncated[sl], version,
        _rows(first.kept, sl),
      )  # fmt: skip
    done = []
    for slot, req in enumerate(self.slots):
      if req is None:
        continue
      k = out.counts[slot]
      req.add(
        out.tokens[slot, :k], out.logp[slot, :k],
        out.logp_truncated[slot, :k], version,
        _rows(out.kept, (slot, slice(0, k))),
        None if out.routing is None else out.routing[slot, :k],
      )  # fmt: skip
      if not out.active[slot]:
        if req.tokens[-1] in self.stop:
          req.finish = FinishReason.STOP
        done.append(req)
        self.slots[slot] = None
    return done

  def warm_up(self) -> None:
    """Compile, before any request, every decode variant this decoder can
    dispatch: `decode_chunk` for each batch size `_shrink` can make and
    each attention bucket, and `compact` between those sizes. Runs them on
    empty states (a chunk with no active slot leaves at once), so a
    trainer's or benchmark's first batches do not compile mid-rollout."""
    engine, n = self.engine, len(self.slots)
    sizes, size = [n], _MIN_ROWS
    while size <= n // 2:  # the powers of two `_shrink` can pick
      sizes.insert(1, size)
      size *= 2
    states = {n: engine.init_decode_state()}
    for i, size in enumerate(sizes):
      for smaller in sizes[i + 1 :]:
        states[smaller] = engine.compact(states[size], list(range(smaller)))
      for bucket in engine.layout.attend_buckets:
        states[size], _ = engine.decode_chunk(  # donates the state
          states[size], self.stop_arr, attend_len=bucket
        )
    jax.block_until_ready(states)

  def _admit(self):
    """Prefill the waiting requests that fit in free slots (each prompt
    once) and insert them; ([(slot, request)], their Prefix or None)."""
    free = [i for i, r in enumerate(self.slots) if r is None]
    if not free or not self.waiting:
      return [], None
    reqs = [
      self.waiting.popleft() for _ in range(min(len(free), len(self.waiting)))
    ]
    admitted = list(zip(free, reqs))
    prompts = list({id(r.prompt): r.prompt for r in reqs}.values())
    where = {id(p): i for i, p in enumerate(prompts)}
    engine = self.engine
    prefix = engine.prefill_batch(
      engine.params,
      prompts,
      [where[id(r.prompt)] for r in reqs],
      np.stack([r.key for r in reqs]),
      self.sp,
    )
    self.state = engine.insert_batch(
      prefix, self.state, free[: len(reqs)], [self.limit] * len(reqs),
      self.stop_arr,
    )  # fmt: skip
    for slot, req in admitted:
      self.slots[slot] = req
    return admitted, prefix

  def _shrink(self) -> None:
    """Move the live rows into a batch of the next power of two (>=
    _MIN_ROWS) when that halves it at least: a decode step costs about its
    row count, and late in a batch most rows are done."""
    slots = self.slots
    live = [i for i, r in enumerate(slots) if r is not None]
    size = max(_MIN_ROWS, 1 << max(len(live) - 1, 0).bit_length())
    if size > len(slots) // 2:
      return
    free = [i for i, r in enumerate(slots) if r is None]
    rows = live + free[: size - len(live)]
    self.state = self.engine.compact(self.state, rows)
    self.slots = [slots[i] for i in rows]

  def _reach(self) -> int:
    """Cache slots a live row may touch in the next chunk: prompt + tokens
    so far (the newest has no cache entry yet) + up to a chunk more."""
    chunk = self.engine.layout.chunk_steps
    return max(
      len(r.prompt) + min(self.limit, max(len(r.tokens), 1) + chunk) - 1
      for r in self.slots
      if r is not None
    )


def _rows(kept, index):
  """`kept[index]` on every field of a host `KeptSet`, or None."""
  return None if kept is None else jax.tree.map(lambda x: x[index], kept)
