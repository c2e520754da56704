"""Forward passes of the trainer over a `TrainBatch`: log-probs, entropy
and critic values of the response tokens, and the micro-batch row layout.

A model's output at position i of `concat(prompt, response)` predicts token
i + 1, so response token t is read at position P + t − 1
(docs/math/rollout_contract.md §5).

Micro-batch i of n holds rows i, i + n, i + 2n, ... (strided): a contiguous
row block per device stays a contiguous block per device, so splitting
never moves data between devices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcorr import sampling
from jaxcorr.model import Transformer, logprobs_from_hidden, token_logprobs
from jaxcorr.model.exact import exact_token_logprobs
from jaxcorr.model.layers import matmul_precision
from jaxcorr.model.lora import enable_dropout, merge_into
from jaxcorr.train.batch import TrainBatch
from jaxcorr.train.rollouts.stage import engine_length
from jaxcorr.train.rollouts.weights import engine_probe
from jaxcorr.train.run_config import RunConfig


def split_micro(tree: Any, n: int) -> Any:
  """[B, ...] -> [n, B/n, ...], micro-batch i = rows i, i + n, ..."""

  def one(x):
    return x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)

  return jax.tree.map(one, tree)


def merge_micro(tree: Any) -> Any:
  """Inverse of `split_micro`."""

  def one(x):
    x = x.swapaxes(0, 1)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])

  return jax.tree.map(one, tree)


def at_response(x: jax.Array, batch: TrainBatch) -> jax.Array:
  """Per-position outputs `[B, P + T, ...]` of `concat(prompt, response)`
  -> those predicting response token t, read at position P + t − 1
  (docs/math/rollout_contract.md §5): `[B, T, ...]`."""
  t = batch.response_mask.shape[1]
  p = batch.tokens.shape[1] - t
  return x[:, p - 1 : p - 1 + t]


def response_logp(
  run: RunConfig,
  graphdef: Any,
  params: Any,
  batch: TrainBatch,
  *,
  entropy: bool = False,
  dropout_key: jax.Array | None = None,
  routing: bool = False,
) -> Any:
  """log π(response token t) `[B, T]` (and the entropy `[B, T]`) under
  `rollout.logprob_mode`; `dropout_key` switches LoRA dropout on (the
  update's forward only); with `routing`, also the MoE layers'
  `RouterStats` (None for a dense policy) as a last element.

  An MoE policy routes by `replay_experts(run, batch)` (`moe.router_replay`)
  and counts every real token in its balance statistics.
  """
  model = nnx.merge(graphdef, params)
  if dropout_key is not None:
    enable_dropout(model, dropout_key)
  if model.config.num_experts:
    out, stats = _moe_logp(run, model, batch, entropy)
  else:
    out, stats = _dense_logp(run, model, batch, entropy), None
  return (out, stats) if routing else out


def engine_model(run: RunConfig, graphdef: Any, params: Any) -> Any:
  """The policy `params` as the rollout engine holds them: floating leaves
  cast to `rollout.engine_dtype`, in a graph computing in it; a LoRA
  policy's adapters merged when the engine merges them (`DeliveryProbe`:
  cast, then W + scale·A B, the engine's own steps)."""
  cfg = nnx.merge(graphdef, params).config
  if run.lora.enabled:
    probe = engine_probe(run, cfg)
    state = probe.cast(params)
    if probe.merged:
      state = merge_into(probe.abstract_state, state, run.lora.scale)
    return nnx.merge(probe.graphdef, state)
  dtype = jnp.dtype(run.rollout.engine_dtype)
  cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  cast = jax.tree.map(
    lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
    params,
  )
  return nnx.merge(nnx.graphdef(abstract), cast)


def exact_logp(
  run: RunConfig,
  graphdef: Any,
  params: Any,
  batch: TrainBatch,
  *,
  routing: bool = False,
) -> Any:
  """π_old `[B, T]` under `rollout.exact`: `exact_token_logprobs` of the
  policy as the engine holds it (`engine_model`: in the engine's dtype)
  over the batch's rows (one sequence each, packed or not in the update),
  keys over the engine's cache length: the engine's μ bit for bit. With
  `routing`, also the MoE routing `[B, P + T, L_moe, k]` (R2's
  `old_experts`)."""
  logp, experts = exact_token_logprobs(
    engine_model(run, graphdef, params),
    batch.tokens,
    batch.segment_ids,
    batch.temperature,
    engine_length(run),
  )
  logp = at_response(logp, batch)
  return (logp, experts) if routing else logp


def _dense_logp(run: RunConfig, model: Any, batch: TrainBatch, entropy: bool):
  """`response_logp` of a dense policy, by `rollout.logprob_mode`."""
  if run.rollout.logprob_mode != 'full':
    hidden, _ = model.hidden_states(batch.tokens, segment_ids=batch.segment_ids)
    return _logp_from_hidden(run, model, batch, hidden, entropy)
  out = token_logprobs(
    model,
    batch.tokens,
    temperature=batch.temperature,
    segment_ids=batch.segment_ids,
    return_entropy=entropy,
    chunk_size=run.model.logprob_chunk,
    remat=run.model.logprob_remat,
  )
  if entropy:
    return at_response(out[0], batch), at_response(out[1], batch)
  return at_response(out, batch)


def _logp_from_hidden(
  run: RunConfig, model: Any, batch: TrainBatch, hidden: Any, entropy: bool
):
  """`response_logp` from the final hidden states [B, S, D] of the batch's
  tokens (dense or MoE forward), by `rollout.logprob_mode`."""
  mode = run.rollout.logprob_mode
  if mode == 'truncated':
    return _truncated_logp(model, batch, hidden, entropy)
  kept = {}
  if mode == 'replay':
    p = batch.tokens.shape[1] - batch.response_mask.shape[1]
    # Prompt positions get an empty set (scored, then cut by at_response).
    kept = dict(
      kept_ids=jnp.pad(
        batch.kept_ids, ((0, 0), (p - 1, 0), (0, 0)), constant_values=-1
      ),
      kept_count=jnp.pad(batch.kept_count, ((0, 0), (p - 1, 0))),
    )
  cfg = model.config
  out = logprobs_from_hidden(
    hidden[:, :-1],
    model.head_weight(),
    batch.tokens[:, 1:],
    temperature=batch.temperature,
    chunk_size=run.model.logprob_chunk,
    remat=run.model.logprob_remat,
    return_entropy=entropy,
    dtype=cfg.dtype,
    precision=matmul_precision(cfg),
    real_vocab_size=cfg.real_vocab_size,
    **kept,
  )
  if entropy:
    return at_response(out[0], batch), at_response(out[1], batch)
  return at_response(out, batch)


def _truncated_logp(
  model: Any, batch: TrainBatch, hidden: Any, entropy: bool
) -> Any:
  """docs/math/rollout_contract.md §2 'truncated': the engine's rule on the
  trainer's logits, over K' = K_θ ∪ {y_t} (a constant set), with full-vocabulary
  logits."""
  logits = at_response(model.logits(hidden), batch)
  p = batch.tokens.shape[1] - batch.response_mask.shape[1]
  y = batch.tokens[:, p:]
  row = lambda x: x[:, None]  # noqa: E731  [B] -> [B, 1] per position
  temperature = row(batch.temperature)
  keep = sampling.support(
    jax.lax.stop_gradient(logits),
    temperature,
    row(batch.top_k),
    row(batch.top_p),
    row(batch.min_p),
  )
  keep = keep | jax.nn.one_hot(y, logits.shape[-1], dtype=bool)
  _, trunc = sampling.token_logprobs(logits, y, temperature, keep)
  if not entropy:
    return trunc
  z = sampling.scaled_logits(logits, temperature)
  logp_all = jax.nn.log_softmax(z, axis=-1)
  finite = jnp.isfinite(logp_all)
  ent = -jnp.sum(jnp.where(finite, jnp.exp(logp_all) * logp_all, 0.0), axis=-1)
  return trunc, ent


def replay_experts(run: RunConfig, batch: TrainBatch) -> jax.Array | None:
  """The routing an MoE forward replays, `[B, P + T, L_moe, k]` or None:
  the engine's (`'rollout'`, R3), π_old's once prepare has filled it
  (`'old'`, R2), or none."""
  mode = run.moe.router_replay
  if mode == 'rollout':
    if batch.routed_experts is None:
      raise ValueError(
        "moe.router_replay='rollout' but the batch has no routed_experts: "
        'the rollout engine must record routing (it does for MoE policies)'
      )
    return batch.routed_experts
  return batch.old_experts if mode == 'old' else None


def _moe_logp(run: RunConfig, model: Any, batch: TrainBatch, entropy: bool):
  """`response_logp` of an MoE policy (any `rollout.logprob_mode`), with
  its routing: one routed forward, then the mode's log-probs."""
  hidden, _, stats = model.routed_hidden_states(
    batch.tokens,
    segment_ids=batch.segment_ids,
    replay=replay_experts(run, batch),
    token_mask=batch.segment_ids != 0,
  )
  return _logp_from_hidden(run, model, batch, hidden, entropy), stats


def critic_values(graphdef: Any, params: Any, batch: TrainBatch) -> jax.Array:
  """V(state before response token t), `[B, T]` float32."""
  critic = nnx.merge(graphdef, params)
  v = critic(batch.tokens, segment_ids=batch.segment_ids)
  return at_response(v, batch)


def in_chunks(
  fn: Callable[[Any, TrainBatch], jax.Array],
  params: Any,
  batch: TrainBatch,
  n: int,
) -> jax.Array:
  """`fn(params, rows)` over the batch in n micro-batch-sized chunks (the
  memory the update needs, not the whole batch's)."""
  rows = split_micro(batch.for_scoring(), n)
  out = jax.lax.map(lambda r: fn(params, r), rows)
  return merge_micro(out)
