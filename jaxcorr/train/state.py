"""What the device side carries from step to step, and the optimizers.

`TrainState` is the checkpointed pytree (jaxcorr/train/checkpoints/checkpointer.py);
`make_optimizer` builds the RL, critic and SFT optimizers from
`config.optim`; `apply_updates` is the one optimizer step all of them take.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import optax

from jaxcorr.losses import rewards
from jaxcorr.train.run_config import OptimConfig


@flax.struct.dataclass
class TrainState:
  """Everything the device side carries from step to step (checkpointed).

  `params` and `critic_params` are `nnx.State`s; `rng` is a raw uint32[2]
  key; `updates` counts optimizer updates (the schedule's clock).
  """

  params: Any
  opt_state: Any
  kl_ctrl: rewards.KLControllerState
  rng: jax.Array
  updates: jax.Array
  critic_params: Any = None
  critic_opt_state: Any = None


def make_optimizer(
  cfg: OptimConfig, peak_lr: float, total_updates: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """(AdamW with linear warmup then constant or cosine decay, after
  global-norm clipping; its learning-rate schedule)."""
  warmup = min(cfg.warmup_steps, max(total_updates - 1, 0))
  if cfg.schedule == 'cosine':
    schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0 if warmup else peak_lr,
      peak_value=peak_lr,
      warmup_steps=warmup,
      decay_steps=max(total_updates, warmup + 1),
      end_value=peak_lr * cfg.min_lr_ratio,
    )
  elif warmup:
    schedule = optax.join_schedules(
      [
        optax.linear_schedule(0.0, peak_lr, warmup),
        optax.constant_schedule(peak_lr),
      ],
      [warmup],
    )
  else:
    schedule = optax.constant_schedule(peak_lr)
  chain = []
  if cfg.max_grad_norm > 0:
    chain.append(optax.clip_by_global_norm(cfg.max_grad_norm))
  chain.append(
    optax.adamw(
      schedule,
      b1=cfg.b1,
      b2=cfg.b2,
      eps=cfg.eps,
      weight_decay=cfg.weight_decay,
    )
  )
  return optax.chain(*chain), schedule


def apply_updates(
  tx: optax.GradientTransformation,
  grads: Any,
  opt_state: Any,
  params: Any,
  shardings: Any = None,
) -> tuple[Any, Any]:
  """One optimizer step; the new params keep `shardings` (when given), so
  the next call of the step compiles to the same executable."""
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  if shardings is not None:
    params = jax.lax.with_sharding_constraint(params, shardings)
  return params, opt_state
