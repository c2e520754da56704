"""Mixture-of-experts layers: the router, stacked experts, grouped dispatch.

Shapes: N tokens (B x S flattened), D hidden size, E experts, k experts per
token, F expert width, L_moe MoE layers.

`MoEBlock` replaces the SwiGLU MLP of an MoE layer (Qwen3-MoE, Qwen2-MoE,
Mixtral; `TransformerConfig.moe_layers` says which layers):

    logits = x @ router                         [N, E]   float32 always
    top    = top_k(logits, k)  (or the replayed set)      [N, k]
    gates  = softmax(logits[top])       norm_topk_prob (Qwen3-MoE, Mixtral)
           | softmax(logits)[top]       otherwise (Qwen2-MoE)
    y      = sum_j gates_j * expert_{top_j}(x)  (+ sigmoid(x @ g) * shared(x))

Router logits and the top-k choice are float32 whatever the compute dtype,
so bf16 and fp32 policies disagree only where the fp32 logits of the
hidden states they are given disagree. Experts are stored stacked
(gate/up [E, D, F], down [E, F, D], logical axis `expert`) and run as one
grouped matmul over the N * k (token, expert) pairs sorted by expert
(`jax.lax.ragged_dot`): dropless (no capacity factor), no per-expert Python
loop, and k / E of the FLOPs of running every expert (`moe_dispatch='dense'`,
the reference the tests compare against).

Routing replay: given `replay` [N, k] (expert ids, -1 where absent), the
block uses that set instead of its own top-k and recomputes the gates from
its current logits over the set, so the router still receives gradients
through the gates; tokens whose replay row holds a -1 (padding) fall back to
the block's own choice. Each call also returns the block's own choice
(`natural`, for the agreement metrics) and its load-balancing statistics,
reduced over the tokens of `token_mask` only.

LoRA on the experts (jaxcorr/model/lora_experts.py) swaps a stacked kernel
attribute for an `ExpertAdapter`; both dispatches then add its low-rank
term per expert (the grouped one over the same sorted rows).
"""

from __future__ import annotations

from typing import Protocol

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jaxcorr.model.config import TransformerConfig
from jaxcorr.model.layers import (
  MLP,
  Attention,
  LayerCache,
  Linear,
  RMSNorm,
  matmul_precision,
  param,
)
from jaxcorr.sharding import constrain

NO_EXPERT = -1
"""Replay / record sentinel: no routing for this position (padding)."""

EXPERT_PROJECTIONS = ('gate_proj', 'up_proj', 'down_proj')
"""`MoEBlock`'s stacked expert kernels, in dispatch order."""


class ExpertAdapter(Protocol):
  """A low-rank term on a stacked expert kernel (`ExpertLora`)."""

  def kernel(self) -> jax.Array:
    """The stacked base kernel [E, in, out] in compute dtype."""
    ...

  def grouped(self, h, sizes, precision=None) -> jax.Array:
    """The term for expert-sorted rows h [M, in] -> [M, out]."""
    ...

  def dense(self, h, precision=None) -> jax.Array:
    """The term of every expert: h [N, in] or [E, N, in] -> [E, N, out]."""
    ...


Adapters = tuple[ExpertAdapter | None, ...]


@flax.struct.dataclass
class RouterStats:
  """One MoE call's routing (per layer, or stacked over the MoE layers).

  With L = L_moe layers stacked on the third axis (`stack_stats`):
  """

  experts: jax.Array  # [B, S, L, k] int32 experts used (replayed if given)
  natural: jax.Array  # [B, S, L, k] int32 the router's own top-k
  aux_loss: jax.Array  # [L] Switch load-balancing loss (1 when uniform)
  z_loss: jax.Array  # [L] mean squared logsumexp of the router logits
  load: jax.Array  # [L, E] fraction of the k * N choices per expert


def routing_shape(cfg: TransformerConfig) -> tuple[int, int, int] | None:
  """(L_moe, k, E) of a policy's routing records; None when dense."""
  if not cfg.num_experts:
    return None
  return len(cfg.moe_layers), cfg.num_experts_per_tok, cfg.num_experts


def stack_stats(per_layer: list[RouterStats]) -> RouterStats:
  """Stack per-layer stats ([B, S, k], scalars, [E]) on a layer axis."""
  return RouterStats(
    experts=jnp.stack([s.experts for s in per_layer], axis=2),
    natural=jnp.stack([s.natural for s in per_layer], axis=2),
    aux_loss=jnp.stack([s.aux_loss for s in per_layer]),
    z_loss=jnp.stack([s.z_loss for s in per_layer]),
    load=jnp.stack([s.load for s in per_layer]),
  )


def route(
  logits: jax.Array,
  k: int,
  norm_topk_prob: bool,
  replay: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """float32 logits [..., E] -> (experts used, gates, natural top-k) [..., k].

  `replay` [..., k] fixes the set where it holds no `NO_EXPERT`; the gates
  are always a differentiable function of `logits` over the set used.
  """
  _, natural = jax.lax.top_k(logits, k)
  natural = natural.astype(jnp.int32)
  experts = natural
  if replay is not None:
    valid = jnp.all(replay >= 0, axis=-1, keepdims=True)
    experts = jnp.where(valid, replay.astype(jnp.int32), natural)
  if norm_topk_prob:
    # softmax over the chosen logits == full softmax re-normalised over them.
    gates = jax.nn.softmax(
      jnp.take_along_axis(logits, experts, axis=-1), axis=-1
    )
  else:
    gates = jnp.take_along_axis(
      jax.nn.softmax(logits, axis=-1), experts, axis=-1
    )
  return experts, gates, natural


def balance_stats(
  logits: jax.Array, natural: jax.Array, mask: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(aux_loss, z_loss, load [E]) over the tokens where `mask` [N] is set.

  aux_loss = E * sum_e f_e * P_e (Switch Transformer): f_e the fraction of
  the k * N choices going to e (the router's own top-k, not a replayed set:
  the loss balances the router), P_e the mean router probability of e.
  z_loss = mean (logsumexp logits)^2 (ST-MoE). An all-False mask gives 0.
  """
  e = logits.shape[-1]
  w = mask.astype(jnp.float32)
  n = jnp.maximum(w.sum(), 1.0)
  onehot = jax.nn.one_hot(natural, e, dtype=jnp.float32).sum(-2)  # [N, E]
  load = (onehot * w[:, None]).sum(0) / (n * natural.shape[-1])
  probs = jax.nn.softmax(logits, axis=-1)
  mean_prob = (probs * w[:, None]).sum(0) / n
  aux = e * jnp.sum(jax.lax.stop_gradient(load) * mean_prob)
  z = jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)) * w) / n
  return aux, z, load


def grouped_experts(
  x: jax.Array,
  experts: jax.Array,
  gates: jax.Array,
  w_gate: jax.Array,
  w_up: jax.Array,
  w_down: jax.Array,
  precision: jax.lax.Precision | None = None,
  adapters: Adapters = (None, None, None),
) -> jax.Array:
  """sum_j gates[n, j] * SwiGLU_{experts[n, j]}(x[n]) as one grouped matmul.

  x [N, D]; experts, gates [N, k]; w_gate, w_up [E, D, F]; w_down [E, F, D];
  adapters: a low-rank term (or None) per kernel, in that order.
  The N * k (token, expert) pairs are sorted by expert so each expert's rows
  are contiguous; `ragged_dot` multiplies each group by its own kernel.
  """
  n, k = experts.shape
  e = w_gate.shape[0]
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  rows = x[order // k]  # [N * k, D], grouped by expert
  sizes = jnp.bincount(flat, length=e).astype(jnp.int32)

  def dot(a, w, lr):
    out = jax.lax.ragged_dot(a, w, sizes, precision=precision)
    if lr is None:
      return out
    return out + lr.grouped(a, sizes, precision).astype(out.dtype)

  lg, lu, ld = adapters
  h = jax.nn.silu(dot(rows, w_gate, lg)) * dot(rows, w_up, lu)
  y = dot(h, w_down, ld) * gates.reshape(-1)[order][:, None].astype(x.dtype)
  # Un-sort (a permutation) and add each token's k outputs in a fixed order.
  y = jnp.zeros_like(y).at[order].set(y)
  return y.reshape(n, k, -1).sum(axis=1)


def dense_experts(
  x: jax.Array,
  experts: jax.Array,
  gates: jax.Array,
  w_gate: jax.Array,
  w_up: jax.Array,
  w_down: jax.Array,
  precision: jax.lax.Precision | None = None,
  adapters: Adapters = (None, None, None),
) -> jax.Array:
  """The reference: every expert on every token, weighted by a dense [N, E]
  gate matrix (zero off the chosen set). Same signature as
  `grouped_experts`."""
  e = w_gate.shape[0]
  weight = jnp.einsum(
    'nk,nke->ne', gates, jax.nn.one_hot(experts, e, dtype=gates.dtype)
  )
  lg, lu, ld = adapters

  def plus(out, lr, h):
    return out if lr is None else out + lr.dense(h, precision).astype(out.dtype)

  g = plus(jnp.einsum('nd,edf->enf', x, w_gate, precision=precision), lg, x)
  u = plus(jnp.einsum('nd,edf->enf', x, w_up, precision=precision), lu, x)
  h = jax.nn.silu(g) * u
  y = plus(jnp.einsum('enf,efd->end', h, w_down, precision=precision), ld, h)
  return jnp.einsum('end,ne->nd', y, weight.astype(x.dtype))


_DISPATCH = {'grouped': grouped_experts, 'dense': dense_experts}


class MoEBlock(nnx.Module):
  """Router + stacked SwiGLU experts (+ Qwen2-MoE's gated shared expert)."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    self.k = cfg.num_experts_per_tok
    self.norm_topk_prob = cfg.norm_topk_prob
    self.dispatch = cfg.moe_dispatch
    self.dtype = cfg.dtype
    self.precision = matmul_precision(cfg)
    self.router = param(rngs, (d, e), ('embed', None), cfg)
    self.gate_proj = param(rngs, (e, d, f), ('expert', 'embed', 'mlp'), cfg)
    self.up_proj = param(rngs, (e, d, f), ('expert', 'embed', 'mlp'), cfg)
    self.down_proj = param(rngs, (e, f, d), ('expert', 'mlp', 'embed'), cfg)
    fs = cfg.shared_expert_intermediate_size
    self.shared_expert = (
      MLP(cfg.replace(intermediate_size=fs), rngs=rngs) if fs else None
    )
    self.shared_gate = (
      Linear('bsd,do->bso', (d, 1), ('embed', None), cfg, rngs=rngs)
      if fs
      else None
    )

  def __call__(
    self,
    x: jax.Array,
    replay: jax.Array | None = None,
    token_mask: jax.Array | None = None,
    dispatch: str | None = None,
  ) -> tuple[jax.Array, RouterStats]:
    """x [B, S, D] -> (y [B, S, D], stats with [B, S, k] experts, scalars).

    replay: [B, S, k] int expert ids (`NO_EXPERT` rows: route freely);
    token_mask: [B, S] bool, the tokens the balance statistics count;
    dispatch: overrides `moe_dispatch` ('dense': each token's result
    independent of the others', what exact mode needs).
    """
    b, s, d = x.shape
    flat = x.reshape(b * s, d)
    logits = jnp.einsum(
      'nd,de->ne',
      flat.astype(jnp.float32),
      self.router[...].astype(jnp.float32),
      precision=jax.lax.Precision.HIGHEST,
    )
    rep = None if replay is None else replay.reshape(b * s, self.k)
    experts, gates, natural = route(logits, self.k, self.norm_topk_prob, rep)
    mask = (
      jnp.ones((b * s,), bool)
      if token_mask is None
      else token_mask.reshape(-1).astype(bool)
    )
    aux, z, load = balance_stats(logits, natural, mask)
    run = _DISPATCH[dispatch or self.dispatch]
    kernels, adapters = self._experts()
    y = run(
      flat.astype(self.dtype),
      experts,
      gates,
      *kernels,
      self.precision,
      adapters,
    ).reshape(b, s, d)
    if self.shared_expert is not None:
      gate = jax.nn.sigmoid(self.shared_gate(x).astype(jnp.float32))
      y = y + (gate * self.shared_expert(x).astype(jnp.float32)).astype(y.dtype)
    stats = RouterStats(
      experts=experts.reshape(b, s, self.k),
      natural=natural.reshape(b, s, self.k),
      aux_loss=aux,
      z_loss=z,
      load=load,
    )
    return y, stats

  def _experts(self) -> tuple[tuple[jax.Array, ...], Adapters]:
    """The stacked kernels in compute dtype and their adapters (None
    where a kernel is a plain `nnx.Param`)."""
    kernels, adapters = [], []
    for name in EXPERT_PROJECTIONS:
      p = getattr(self, name)
      plain = isinstance(p, nnx.Variable)
      kernels.append(p[...].astype(self.dtype) if plain else p.kernel())
      adapters.append(None if plain else p)
    return tuple(kernels), tuple(adapters)


class MoEDecoderLayer(nnx.Module):
  """`DecoderLayer` with an `MoEBlock` in place of the MLP (same param
  names, so checkpoints map layer by layer), also returning its routing."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.hidden_size, cfg)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.hidden_size, cfg)
    self.mlp = MoEBlock(cfg, rngs=rngs)

  def __call__(
    self,
    x: jax.Array,
    rope: tuple[jax.Array, jax.Array],
    mask: jax.Array,
    cache: LayerCache | None = None,
    cache_index: jax.Array | None = None,
    attend_len: int | None = None,
    replay: jax.Array | None = None,
    token_mask: jax.Array | None = None,
  ) -> tuple[jax.Array, LayerCache | None, RouterStats]:
    """x [B, S, D] -> ([B, S, D], updated cache or None, routing)."""
    h, cache = self.attn(
      self.attn_norm(x), rope, mask, cache, cache_index, attend_len
    )
    x = x + h
    y, stats = self.mlp(self.mlp_norm(x), replay, token_mask)
    x = x + y
    return constrain(x, ('batch', 'seq', 'act_embed')), cache, stats
