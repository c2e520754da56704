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
fold_in(fold_in(PRNGKey(seed), first_prompt + i), s): its random numbers
depend neither on the slot it lands in nor on the other requests, and a host
sampling its share of a global batch (`first_prompt` = the global index of
its first prompt) draws what one host sampling the whole batch would.

That makes the draws slot-invariant, and with them (near-ties aside) the
tokens, but not the numbers computed with them. Outside exact mode (`rollout.exact`, docs/rollout.md "Exact mode") a
row's logits are summed in an order that depends on how many rows the
matmuls hold, so its log-probs move with the slot count and the chunk: 16
prompts x 4 samples x 32 tokens, 3 slots / 4-step chunks against 16 slots /
1-step chunks, gave the same 2048 tokens, with log-probs apart by up to
9.9e-3 in bfloat16 (2% of them not bit-equal) and 3.8e-6 in float32 (78%);
a tiny Qwen3-MoE policy in bfloat16, up to 8.3e-3. Its routing (top-k of
router scores that carry the same rounding) matched on all 2536 positions
there, but a near-tie between two experts can flip it, as a near-tie
between two candidates can flip a token; neither happened in that
measurement. In exact mode the log-probs and the routing are bit-equal
whatever the slots (tests/rollout/test_exact.py).

The continuous batching itself (slots, chunks, shrinking, in-flight weight
swaps) is `decoder.Decoder`; the host syncs once per chunk, and a chunk's
tokens all carry the policy version of its dispatch (weights change only
between dispatches).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jaxcorr.model.moe import routing_shape
from jaxcorr.rollout import precision
from jaxcorr.rollout.decoder import Decoder, Request
from jaxcorr.rollout.engine import PolicyEngine
from jaxcorr.rollout.state import SamplingParams
from jaxcorr.rollout.types import RolloutBatch


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


def request_keys(seed: int, first_prompt: int, prompts: int, samples: int):
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
  decoder = Decoder(
    engine, sp=sp, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids
  )
  keys = request_keys(seed, first_prompt, len(prompts), num_samples)
  prompts = [list(p) for p in prompts]  # one list per prompt: shared prefill
  for i, prompt in enumerate(prompts):
    for s in range(num_samples):
      row = i * num_samples + s
      decoder.submit(Request(row, i, s, prompt, keys[row]))
  done: list[Request] = []
  while decoder.busy:
    done += decoder.advance(final=True)
  done.sort(key=lambda r: r.row)
  return to_batch(engine, done, max_new_tokens, sp)


def to_batch(
  engine: PolicyEngine, done: Sequence[Request], t: int, sp: SamplingParams
) -> RolloutBatch:
  """Finished requests (row i at position i) -> a host `RolloutBatch` with
  P = the longest prompt and T = t response positions."""
  b = len(done)
  p = max(len(r.prompt) for r in done)
  return RolloutBatch(
    **_kept_fields(done, b, t, engine.kept_set_capacity),
    **_routing_fields(done, b, p, t, routing_shape(engine.config)),
    **sequence_fields(done, p, t, sp),
    engine_name='jaxcorr.PolicyEngine/jetstream',
    **precision.stored_dtypes(engine),
  )


def sequence_fields(
  records: Sequence,
  p: int,
  t: int,
  sp: SamplingParams,
  trained: Sequence[Sequence[bool]] | None = None,
) -> dict[str, np.ndarray]:
  """The `RolloutBatch` fields of sampled sequences, record i in row i:
  prompts left-padded to P, responses right-padded to T, and per row its
  sampling parameters, finish reason, group and sample ids.

  Args:
    records: `decoder.Request`s or `agents.trajectory.Trajectory`s (each
      with prompt, tokens, logp, logp_truncated, versions, finish, group,
      sample).
    trained: per record, which response tokens are the policy's (a
      multi-turn trajectory's agent tokens); None: all of them. The others
      are context: outside `response_mask`, with no μ and version -1.
  """
  b = len(records)
  prompt_tokens = np.zeros((b, p), np.int32)
  prompt_mask = np.zeros((b, p), bool)
  response = np.zeros((b, t), np.int32)
  context = np.zeros((b, t), bool)
  mask = np.zeros((b, t), bool)
  logp = np.zeros((b, t), np.float32)
  logp_t = np.zeros((b, t), np.float32)
  version = np.full((b, t), -1, np.int32)
  for i, r in enumerate(records):
    q, n = r.prompt, len(r.tokens)
    if len(q) > p or n > t:
      raise ValueError(
        f'row {i}: {len(q)} prompt / {n} response tokens exceed [{p}, {t}]'
      )
    prompt_tokens[i, p - len(q) :] = q
    prompt_mask[i, p - len(q) :] = True
    response[i, :n] = r.tokens
    context[i, :n] = True
    mask[i, :n] = True if trained is None else np.asarray(trained[i], bool)
    logp[i, :n] = r.logp
    logp_t[i, :n] = r.logp_truncated
    version[i, :n] = r.versions
  return dict(
    prompt_tokens=prompt_tokens,
    prompt_mask=prompt_mask,
    response_tokens=response,
    context_mask=context,
    response_mask=mask,
    rollout_logp=np.where(mask, logp, 0.0).astype(np.float32),
    rollout_logp_truncated=np.where(mask, logp_t, 0.0).astype(np.float32),
    temperature=np.full((b,), sp.temperature, np.float32),
    top_k=np.full((b,), sp.top_k, np.int32),
    top_p=np.full((b,), sp.top_p, np.float32),
    min_p=np.full((b,), sp.min_p, np.float32),
    policy_version=np.where(mask, version, -1).astype(np.int32),
    finish_reason=np.asarray([r.finish for r in records], np.int8),
    group_id=np.asarray([r.group for r in records], np.int32),
    sample_id=np.asarray([r.sample for r in records], np.int32),
  )


def _routing_fields(done, b, p, t, moe) -> dict:
  """`routed_experts` [B, P + T, L_moe, k] (docs/moe.md): the prompt's
  routing left-padded like its tokens, then the fed response tokens'; -1
  elsewhere (padding and each row's newest token). Empty for dense."""
  if moe is None:
    return {}
  layers, k, _ = moe
  out = np.full((b, p + t, layers, k), -1, np.int32)
  for r in done:
    q = len(r.prompt)
    out[r.row, p - q : p] = r.prompt_routing
    if r.routing:
      fed = np.concatenate(r.routing)[: max(len(r.tokens) - 1, 0)]
      out[r.row, p : p + len(fed)] = fed
  return {'routed_experts': out}


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
