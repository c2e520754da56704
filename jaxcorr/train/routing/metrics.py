"""Routing metrics and balance terms of an MoE policy (jitted, no host sync).

Agreement compares top-k *sets* (the order of the k experts is irrelevant):
a (token, layer) pair agrees when the trainer's own top-k equals the
engine's. Positions where either side holds `NO_EXPERT` (padding, or no
record) do not count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcorr.model.moe import RouterStats
from jaxcorr.train.batch import TrainBatch
from jaxcorr.train.routing.config import MoEConfig


def agreement(
  trainer: jax.Array, engine: jax.Array, mask: jax.Array
) -> dict[str, jax.Array]:
  """Router agreement between two routings [B, S, L, k] on `mask` [B, S].

  Returns `moe/router_agreement` (fraction of (token, layer) pairs with the
  same set), `moe/tokens_differing` (fraction of tokens whose set differs in
  at least one layer) and `moe/agreement/layer<j>` per MoE layer.
  """
  valid = mask[..., None] & jnp.all(engine >= 0, -1) & jnp.all(trainer >= 0, -1)
  same = jnp.all(jnp.sort(trainer, -1) == jnp.sort(engine, -1), -1)  # [B,S,L]
  w = valid.astype(jnp.float32)
  pairs = jnp.maximum(w.sum(), 1.0)
  tok = jnp.any(valid, -1)
  differ = jnp.any(valid & ~same, -1)
  out = {
    'moe/router_agreement': jnp.sum(same * w) / pairs,
    'moe/tokens_differing': jnp.sum(differ) / jnp.maximum(jnp.sum(tok), 1),
  }
  per_layer = jnp.sum(same * w, (0, 1)) / jnp.maximum(w.sum((0, 1)), 1.0)
  for j in range(trainer.shape[2]):
    out[f'moe/agreement/layer{j}'] = per_layer[j]
  return out


def step_terms(
  routing: RouterStats,
  mic: TrainBatch,
  counts: tuple[jax.Array, jax.Array],
  cfg: MoEConfig,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(the balance terms of one update micro-batch, its routing metrics).

  The terms are weighted by the micro-batch's share of the mini-batch's
  loss tokens (`counts[0]`), so padding rows and all-padding micro-batches
  change nothing; the agreement metrics need the engine's routing.
  """
  m = mic.response_mask
  if mic.corr_mask is not None:
    m = m & mic.corr_mask
  share = jnp.sum(m, dtype=jnp.float32) / jnp.maximum(counts[0], 1.0)
  term, met = balance_terms(routing, cfg, share)
  if mic.routed_experts is not None:
    met.update(
      agreement(routing.natural, mic.routed_experts, mic.segment_ids != 0)
    )
  return term, met


def balance_terms(
  stats: RouterStats, cfg: MoEConfig, scale: jax.Array | float = 1.0
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(scale x (aux_coef x aux + z_coef x z), metrics): the balance terms of
  one micro-batch, each a mean over the MoE layers; `moe/load/e<i>` is the
  expert-load histogram (fraction of choices, mean over layers)."""
  aux = jnp.mean(stats.aux_loss)
  z = jnp.mean(stats.z_loss)
  term = scale * (cfg.aux_loss_coef * aux + cfg.z_loss_coef * z)
  load = jnp.mean(stats.load, 0)
  metrics = {'moe/aux_loss': aux, 'moe/z_loss': z}
  for i in range(load.shape[0]):
    metrics[f'moe/load/e{i}'] = load[i]
  return term, metrics
