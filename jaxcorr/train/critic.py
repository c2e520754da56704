"""The critic for GAE: the policy's transformer with a scalar value head.

    tokens [B, S] -> Transformer.hidden_states -> [B, S, D] @ w [D] -> [B, S]

Like the policy's log-probs, the value of response token t is read at
position P + t − 1 (the state *before* the token is emitted), so values,
log-probs and rewards share one `[B, T]` alignment. The backbone starts
from the policy's weights (verl initialises its critic from the actor) and
the head from zeros, so the first values are 0 and GAE starts as REINFORCE
with returns as targets. `CriticConfig` is its config section (the value
loss's clipping and aggregation are read by jaxcorr/train/step.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcorr.config.fields import boolean, canonical, number, setting, validate
from jaxcorr.losses import aggregate as agg_lib
from jaxcorr.model import Transformer, TransformerConfig
from jaxcorr.model.layers import param
from jaxcorr.train.state import copy_tree


@dataclasses.dataclass(frozen=True)
class CriticConfig:
  """The value model for GAE (a copy of the policy with a scalar head)."""

  enabled: bool = setting(
    False, boolean, "Train a critic; required by algorithm.estimator='gae'."
  )
  learning_rate: float = setting(
    1e-5, number(0), 'Peak learning rate of the critic.'
  )
  cliprange_value: float = setting(
    0.5, number(0, lo_open=True), 'Value clipping ε of the clipped value loss.'
  )
  agg: str = setting(
    'token_mean',
    canonical(agg_lib.canonical_mode),
    'Aggregation of the value loss (a token/seq mode of aggregate).',
  )

  def __post_init__(self):
    validate(self)


class ValueModel(nnx.Module):
  """A `Transformer` backbone plus a `[D]` value head (logical `embed`)."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.backbone = Transformer(config, rngs=rngs)
    self.head = param(None, (config.hidden_size,), ('embed',), config, 'zeros')

  def __call__(
    self,
    tokens: jax.Array,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
  ) -> jax.Array:
    """Values `[B, S]` float32 of every position (`positions` as in
    `Transformer.hidden_states`: packed rows pass their sequences' own)."""
    hidden, _ = self.backbone.hidden_states(
      tokens, positions=positions, segment_ids=segment_ids
    )
    return jnp.einsum(
      'bsd,d->bs',
      hidden.astype(jnp.float32),
      self.head[...].astype(jnp.float32),
    )


def init_from_policy(critic: ValueModel, policy: Transformer) -> None:
  """Copy the policy's weights into the critic's backbone (in place).

  Copies, not shares: the update step donates the policy's and the critic's
  buffers together, and XLA refuses to donate one buffer twice ("Attempt to
  donate the same buffer twice"); `copy_tree` keeps the shardings (the
  objects themselves: the critic reaches `prepare` as a restored one does).
  """
  nnx.update(critic.backbone, copy_tree(nnx.state(policy, nnx.Param)))
