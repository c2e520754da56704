"""Offline continuous batching over a JetStream engine -> `RolloutBatch`.

    queue of requests (prompt i, sample s) --prefill--> free slot --insert-->
    generate steps (all slots at once) --> retire on stop token / length
    --> slot freed and refilled from the queue

JetStream 0.2.2's orchestrator returns text only, so jaxcorr drives the
engine itself and keeps the per-token log-probs its `PolicyEngine` returns.
Request r = (prompt i, sample s) draws with the key
fold_in(fold_in(PRNGKey(seed), first_prompt + i), s): its tokens depend
neither on the slot it lands in nor on the other requests, so any slot count
gives the same batch, and a host sampling its share of a global batch
(`first_prompt` = the global index of its first prompt) draws what one host
sampling the whole batch would. The loop runs on the host and syncs once per
decode step (to retire finished requests); the steps themselves are jitted
in the engine.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import jax
import numpy as np

from jaxcorr.rollout.engine import PolicyEngine, SamplingParams
from jaxcorr.rollout.types import FinishReason, RolloutBatch


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
    self.finish = FinishReason.LENGTH

  def add(self, token, logp, logp_t, version, stop, limit) -> bool:
    """Append one sampled token; True when the request is finished."""
    self.tokens.append(int(token))
    self.logp.append(float(logp))
    self.logp_truncated.append(float(logp_t))
    self.versions.append(version)
    if int(token) in stop:
      self.finish = FinishReason.STOP
      return True
    return len(self.tokens) >= limit


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
  root = jax.random.PRNGKey(seed)
  queue = collections.deque(
    _Request(i * num_samples + s, i, s)
    for i in range(len(prompts))
    for s in range(num_samples)
  )
  done: list[_Request] = []
  slots: list[_Request | None] = [None] * engine.max_concurrent_decodes
  state = engine.init_decode_state()
  while queue or any(slots):
    for slot in range(len(slots)):
      while slots[slot] is None and queue:
        req = queue.popleft()
        padded, n = engine.pad_prompt(prompts[req.group])
        key = jax.random.fold_in(
          jax.random.fold_in(root, first_prompt + req.group), req.sample
        )
        prefix = engine.prefill(
          params=engine.params,
          padded_tokens=padded,
          true_length=n,
          sampling_params=sp,
          key=key,
        )
        first = jax.device_get(
          (prefix.token, prefix.logp, prefix.logp_truncated)
        )
        if req.add(*first, engine.policy_version, stop, max_new_tokens):
          done.append(req)  # finished on its first token: slot stays free
        else:
          state = engine.insert(prefix, state, slot)
          slots[slot] = req
    if not any(slots):
      continue
    state, result = engine.generate(engine.params, state)
    result = result.convert_to_numpy()
    logp, logp_t = result.logprobs()
    tokens = result.data[:, result.tokens_idx[0]]
    for slot, req in enumerate(slots):
      if req is not None and req.add(
        tokens[slot],
        logp[slot],
        logp_t[slot],
        engine.policy_version,
        stop,
        max_new_tokens,
      ):
        done.append(req)
        slots[slot] = None
  done.sort(key=lambda r: r.row)
  return _to_batch(engine, prompts, done, max_new_tokens, sp)


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
