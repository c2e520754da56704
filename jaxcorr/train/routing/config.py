"""The `moe` config section: router replay and the balance terms.

Read by the trainer only (jaxcorr/train/scoring.py, step.py, prepare.py);
the model's MoE shape lives in the `model` section. Off by default: a dense
run ignores the section, and an MoE run with the defaults routes freely and
adds no term to its loss.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxcorr.config.fields import fail, number, one_of, setting, validate

REPLAY_MODES = ('none', 'old', 'rollout')


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """How the trainer routes tokens of an MoE policy (docs/moe.md)."""

  router_replay: str = setting(
    'none',
    one_of(*REPLAY_MODES),
    "'none': every trainer pass routes by its own router; 'old' (R2): the "
    "update micro-batches replay the routing of the trainer's pi_old pass; "
    "'rollout' (R3): every trainer pass replays the engine's routing "
    '(RolloutBatch.routed_experts). Gates are recomputed from the current '
    'router logits over the replayed set, so the router keeps its gradients.',
  )
  aux_loss_coef: float = setting(
    0.0,
    number(0),
    'Weight of the Switch load-balancing loss (mean over MoE layers) in '
    'the actor loss.',
  )
  z_loss_coef: float = setting(
    0.0,
    number(0),
    'Weight of the router z-loss (mean over MoE layers) in the actor loss.',
  )

  def __post_init__(self):
    validate(self)


def check_model(moe: MoEConfig, model: Any) -> None:
  """Router replay needs routing to replay: refused for a dense policy
  (`model`: its `TransformerConfig`), where it would run and replay
  nothing."""
  if moe.router_replay != 'none' and not model.num_experts:
    fail(
      'config.moe.router_replay',
      moe.router_replay,
      f"'none' for a dense model ({model.architecture}, no experts)",
      'router replay replays MoE routing; set model.num_experts and '
      "model.architecture='MixtralForCausalLM' for a scratch MoE model",
    )
