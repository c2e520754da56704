"""Device side of packing: forward passes over `PackedRows`, read back in
the `[rows, T]` response layout of a mini-batch.

The policy (or the critic) runs on a micro-batch's R packed rows (segment
ids keep attention inside each sequence, positions are the sequences'
own); its per-position log-probs and entropies (or values) are gathered
back to the mini-batch's `[mb, T]` rows by `PackedRows.gather`. A
micro-batch's view of the mini-batch (`micro_view`) is the mini-batch with
the response mask of the rows of other micro-batches off: the losses see
every row of the mini-batch, those of other micro-batches empty (empty
rows change no loss, gradient or metric: jaxcorr/train/batch.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcorr import sharding
from jaxcorr.model import logprobs_from_hidden
from jaxcorr.model.layers import matmul_precision
from jaxcorr.model.lora import enable_dropout
from jaxcorr.train import scoring
from jaxcorr.train.batch import TrainBatch
from jaxcorr.train.packing.layout import PackedRows
from jaxcorr.train.run_config import RunConfig


def _gather(x: jax.Array, index: jax.Array) -> jax.Array:
  """`[R, L]` packed outputs -> `[mb, T]` at the flat `index` `[mb, T]`."""
  return jnp.take(x.reshape(-1), index, axis=0)


def response_logp(
  run: RunConfig,
  graphdef: Any,
  params: Any,
  micro: PackedRows,
  *,
  entropy: bool = False,
  dropout_key: jax.Array | None = None,
) -> Any:
  """log π(response token t) `[mb, T]` (and the entropy) of one micro-batch
  (`micro`: one mini-batch's, one micro-batch's `PackedRows` fields, no
  leading axes), `logprob_mode='full'`; `dropout_key` as in
  `jaxcorr.train.scoring.response_logp`."""
  model = nnx.merge(graphdef, params)
  if model.config.num_experts:  # an HF MoE checkpoint (config: build.py)
    raise ValueError(
      'config.train.packing=True needs a dense policy: the packed forward '
      'does not replay MoE routing yet; set config.train.packing=False'
    )
  if dropout_key is not None:
    enable_dropout(model, dropout_key)
  tokens = micro.tokens
  hidden, _ = model.hidden_states(
    tokens, positions=micro.positions, segment_ids=micro.segment_ids
  )
  cfg = model.config
  out = logprobs_from_hidden(
    hidden[:, :-1],
    model.head_weight(),
    tokens[:, 1:],
    temperature=micro.temperature[:, :-1],
    chunk_size=run.model.logprob_chunk,
    remat=run.model.logprob_remat,
    return_entropy=entropy,
    dtype=cfg.dtype,
    precision=matmul_precision(cfg),
    real_vocab_size=cfg.real_vocab_size,
  )
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 1)))  # noqa: E731  [R, L]
  if entropy:
    return _gather(pad(out[0]), micro.gather), _gather(
      pad(out[1]), micro.gather
    )
  return _gather(pad(out), micro.gather)


def policy_logp(
  run: RunConfig,
  graphdef: Any,
  params: Any,
  mic: TrainBatch,
  micro: PackedRows | None,
  *,
  entropy: bool = False,
  dropout_key: jax.Array | None = None,
) -> Any:
  """The policy's response log-probs (and entropy) `[rows, T]` of the
  micro-batch `mic`: over its own rows, or with packing (`micro`) over its
  packed rows; `dropout_key`: LoRA dropout on (the update's forward)."""
  if micro is None:
    return scoring.response_logp(
      run, graphdef, params, mic, entropy=entropy, dropout_key=dropout_key
    )
  return response_logp(
    run, graphdef, params, micro, entropy=entropy, dropout_key=dropout_key
  )


def response_values(graphdef: Any, params: Any, micro: PackedRows) -> Any:
  """The critic's V(state before response token t) `[mb, T]` of one
  micro-batch's packed rows (`micro` as in `response_logp`): the value at
  the position whose output predicts token t, the one `gather` reads."""
  critic = nnx.merge(graphdef, params)
  v = critic(
    micro.tokens, positions=micro.positions, segment_ids=micro.segment_ids
  )
  return _gather(v, micro.gather)


def critic_values(
  graphdef: Any, params: Any, mic: TrainBatch, micro: PackedRows | None
) -> jax.Array:
  """The critic's values `[rows, T]` of the micro-batch `mic`: over its own
  rows, or with packing (`micro`) over its packed rows."""
  if micro is None:
    return scoring.critic_values(graphdef, params, mic)
  return response_values(graphdef, params, micro)


def micro_view(mb: TrainBatch, member: jax.Array) -> TrainBatch:
  """The mini-batch `mb` as one micro-batch's loss sees it: the response
  mask of rows outside the micro-batch (`member` `[mb]` False) off."""
  return mb.replace(response_mask=mb.response_mask & member[:, None])


def minibatch(batch: TrainBatch, packed: PackedRows | None, m: jax.Array):
  """(the batch rows of mini-batch m `[mb, ...]`, its micro-batches'
  `PackedRows` `[n, ...]`, `rows` left out: what a scan over them takes).
  Unpacked (`packed` None): (the rows `m`, None)."""
  if packed is None:
    return jax.tree.map(lambda x: x[m], batch), None
  sub = jax.tree.map(lambda x: x[packed.rows[m]], batch)
  micros = jax.tree.map(lambda x: x[m], packed.replace(rows=None))
  return sub, micros


def to_device(mesh: Any, packed: PackedRows) -> PackedRows:
  """Host `PackedRows` of the whole batch (the same on every process) ->
  global device arrays: the packed rows (axis 2) over the batch axes of
  `mesh`, the index arrays replicated. Each process puts only the shards
  of its own devices."""

  def put(x, axes):
    sh = sharding.logical_sharding(axes, mesh)
    return jax.make_array_from_callback(x.shape, sh, lambda index: x[index])

  rows = (None, None, 'batch', None)
  return packed.replace(
    tokens=put(packed.tokens, rows),
    positions=put(packed.positions, rows),
    segment_ids=put(packed.segment_ids, rows),
    temperature=put(packed.temperature, rows),
    rows=put(packed.rows, (None, None)),
    member=put(packed.member, (None, None, None)),
    gather=put(packed.gather, (None,) * 4),
  )


def in_micro_batches(
  fn: Callable[[Any, PackedRows], jax.Array],
  params: Any,
  packed: PackedRows,
  rows: int,
) -> jax.Array:
  """`fn(params, micro) -> [mb, T]` over every micro-batch, one at a time,
  assembled into the `[rows, T]` of the whole batch (each row's values
  from its micro-batch; rows that pack nothing get 0)."""
  big_m, n = packed.tokens.shape[:2]
  flat = jax.tree.map(
    lambda x: x.reshape(big_m * n, *x.shape[2:]), packed.replace(rows=None)
  )
  out = jax.lax.map(lambda mic: fn(params, mic), flat)  # [M n, mb, T]
  out = out.reshape(big_m, n, *out.shape[1:])
  member = packed.member[..., None]
  per_row = jnp.sum(jnp.where(member, out, 0.0), axis=1)  # [M, mb, T]
  t = per_row.shape[-1]
  full = jnp.zeros((rows, t), per_row.dtype)
  return full.at[packed.rows.reshape(-1)].set(per_row.reshape(-1, t))
