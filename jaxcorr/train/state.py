"""What the device side carries from step to step, and the optimizers.

`TrainState` is the checkpointed pytree (jaxcorr/train/checkpoints/checkpointer.py);
`OptimConfig` is the `optim` config section, and `make_optimizer` builds the
RL, critic and SFT optimizers from it; `init_optimizer` makes their state
where the params are; `apply_updates` is the one optimizer step all of them
take.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import optax
from flax import nnx

from jaxcorr.config.fields import integer, number, one_of, setting, validate
from jaxcorr.losses import rewards
from jaxcorr.train import mixed_precision

_NAT = integer(0)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """optax AdamW with warmup + cosine decay and global-norm clipping."""

  learning_rate: float = setting(
    1e-6, number(0), 'Peak learning rate of the RL phase.'
  )
  sft_learning_rate: float = setting(
    1e-3,
    number(0),
    'Peak learning rate of the SFT warm-up (its own schedule and moments).',
  )
  warmup_steps: int = setting(
    0, _NAT, 'Linear warmup steps (optimizer updates), then the schedule.'
  )
  schedule: str = setting(
    'constant',
    one_of('constant', 'cosine'),
    "'constant' or 'cosine' (to min_lr_ratio * peak at the last update).",
  )
  min_lr_ratio: float = setting(
    0.1, number(0, 1), 'Final fraction of the peak of the cosine schedule.'
  )
  weight_decay: float = setting(
    0.0, number(0), "AdamW's decoupled weight decay."
  )
  b1: float = setting(
    0.9, number(0, 1, hi_open=True), "AdamW's first-moment decay."
  )
  b2: float = setting(
    0.999, number(0, 1, hi_open=True), "AdamW's second-moment decay."
  )
  eps: float = setting(1e-8, number(0, lo_open=True), "AdamW's epsilon.")
  max_grad_norm: float = setting(
    1.0, number(0), 'Global-norm gradient clipping (0: off).'
  )

  def __post_init__(self):
    validate(self)


@flax.struct.dataclass
class TrainState:
  """Everything the device side carries from step to step (checkpointed).

  `params` and `critic_params` are `nnx.State`s; `rng` is a raw uint32[2]
  key; `updates` counts optimizer updates (the schedule's clock). With
  LoRA (`config.lora.rank > 0`) `params` holds only the adapters (what is
  trained, optimised and checkpointed) and `frozen` the base weights,
  passed through every update untouched (donated, never copied);
  `policy_params` joins them into the policy's whole state.
  """

  params: Any
  opt_state: Any
  kl_ctrl: rewards.KLControllerState
  rng: jax.Array
  updates: jax.Array
  critic_params: Any = None
  critic_opt_state: Any = None
  frozen: Any = None

  def policy_params(self, params: Any = None) -> Any:
    """The policy's whole state: `params` (default: the trained ones;
    e.g. the reference's adapters) joined with the frozen base, if any."""
    params = self.params if params is None else params
    if self.frozen is None or params is None:
      return params
    return nnx.merge_state(self.frozen, params)


def copy_tree(tree: Any) -> Any:
  """A device copy of a pytree of arrays (one batched transfer), each in
  its input's sharding object. A jitted copy returned XLA's respelling of
  the sharding (P('fsdp',) for P('fsdp', 'tensor')): equal in layout, yet
  another program for a jitted function that reads it, so a reference
  copied after SFT made a fresh run's `prepare` another program than a
  restored run's (a miss in the persistent compile cache on resume).
  Each leaf goes to its own sharding, named: with no destination,
  `device_put` refuses arrays that span other processes' devices."""
  shardings = jax.tree.map(lambda x: x.sharding, tree)
  return jax.device_put(tree, shardings, may_alias=False)


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


def optimizer_shardings(
  tx: optax.GradientTransformation, params: Any, mesh: jax.sharding.Mesh
) -> Any:
  """Where `tx.init(params)`'s leaves belong: each copy of the param tree
  in it (AdamW's moments) placed like the params, the rest (step counts)
  replicated. `params` may be abstract (`jax.ShapeDtypeStruct`s)."""
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return optax.tree_map_params(
    tx,
    lambda _, s: s,
    jax.eval_shape(tx.init, params),
    jax.tree.map(lambda x: x.sharding, params),
    transform_non_params=lambda _: replicated,
    is_leaf=lambda x: isinstance(x, nnx.Variable),
  )


def init_optimizer(
  tx: optax.GradientTransformation, params: Any, mesh: jax.sharding.Mesh
) -> Any:
  """`tx.init(params)` born on `optimizer_shardings`. A plain
  `jax.jit(tx.init)` replicates the zeros it makes (nothing ties them to
  the params' shardings): an FSDP run then held every moment whole on
  each chip (60 GiB per chip for an 8B model, found by `jaxcorr.plan`)."""
  shardings = optimizer_shardings(tx, params, mesh)
  with jax.set_mesh(mesh):
    return jax.jit(tx.init, out_shardings=shardings)(params)


def apply_updates(
  tx: optax.GradientTransformation,
  grads: Any,
  opt_state: Any,
  params: Any,
  shardings: Any = None,
  scale: jax.Array | None = None,
) -> tuple[Any, Any]:
  """One optimizer step; the new params keep `shardings` (when given), so
  the next call of the step compiles to the same executable. `scale`
  multiplies the optimizer's update (VCPO's ESS step: the learning rate
  times `scale` for optax's Adam/AdamW chains). `grads` may be float32
  sums over bf16 params: they are cast to the params' dtypes first."""
  grads = mixed_precision.like_params(grads, params)
  updates, opt_state = tx.update(grads, opt_state, params)
  if scale is not None:
    updates = jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates)
  params = optax.apply_updates(params, updates)
  if shardings is not None:
    params = jax.lax.with_sharding_constraint(params, shardings)
  return params, opt_state
