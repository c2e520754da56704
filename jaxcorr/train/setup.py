"""Run set-up: devices and meshes, the optimizer state and the compiled
steps, the prompt loaders (the policy itself: jaxcorr/train/policy.py).

    split_devices ─ Meshes (trainer mesh, engine mesh)
    build_learner ─ TrainState (+ critic, KL controller) and `Steps`
    build_prompts ─ Prompts (RL loader, SFT loader, held-out examples)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcorr import sharding
from jaxcorr.data import prompt_check
from jaxcorr.data import prompts as data
from jaxcorr.data.tasks import Example
from jaxcorr.losses import rewards
from jaxcorr.model.lora import split_adapter
from jaxcorr.model.moe import routing_shape
from jaxcorr.train import run_config as run_lib
from jaxcorr.train.critic import ValueModel
from jaxcorr.train.policy import Policy
from jaxcorr.train.state import TrainState, init_optimizer, make_optimizer
from jaxcorr.train.step import Steps

# ------------------------------------------------------------- devices


class DeviceLayoutError(ValueError):
  """The config asks for a device layout this machine cannot give (a
  start-up error, one line: `jaxcorr.main`)."""


def split_devices(
  run: run_lib.RunConfig, devices: list[Any]
) -> tuple[list[Any], list[Any] | None]:
  """(trainer devices, rollout devices or None = shared)."""
  k = run.rollout.rollout_devices if run.rollout.mode != 'sync' else 0
  if k == 0:
    return devices, None
  if k >= len(devices):
    raise DeviceLayoutError(
      f'config.rollout.rollout_devices={k}: must leave the trainer at least '
      f'one of the {len(devices)} devices'
    )
  return devices[:-k], devices[-k:]


@dataclasses.dataclass(frozen=True)
class Meshes:
  """The trainer's mesh and the rollout engine's (the same one when the
  engine shares the trainer's devices)."""

  train: jax.sharding.Mesh
  rollout: jax.sharding.Mesh

  @property
  def batch_shards(self) -> int:
    """Devices the batch's rows are split over (data x fsdp)."""
    return self.train.shape['data'] * self.train.shape['fsdp']


def make_meshes(run: run_lib.RunConfig) -> Meshes:
  process_count = jax.process_count()
  if process_count > 1 and run.rollout.rollout_devices:
    raise DeviceLayoutError(
      'config.rollout.rollout_devices must be 0 with several processes: '
      'each host samples on its own devices (sub-meshes per host are not '
      'implemented yet)'
    )
  train_devices, rollout_devices = split_devices(run, jax.devices())
  try:
    mesh = sharding.make_mesh(run.mesh, devices=train_devices)
  except ValueError as e:  # the shape does not fit the devices
    raise DeviceLayoutError(f'config.mesh: {e}') from None
  rows = mesh.shape['data'] * mesh.shape['fsdp']
  if rows % process_count:
    # Each host feeds its own rows (batch.to_device): the batch axes must
    # span the processes, which tensor and sequence (within a row) do not.
    raise DeviceLayoutError(
      f'config.mesh: data x fsdp = {rows} must be a multiple of the '
      f'{process_count} processes (each host feeds its own rows; raise '
      'mesh.fsdp, lower mesh.sequence or mesh.tensor)'
    )
  if rollout_devices is None and process_count > 1:
    # Each host samples its own prompts, so its engine must run on its
    # own devices: a global engine mesh would need every host to issue
    # the same prefill/decode sequence.
    here = jax.process_index()
    rollout_devices = [d for d in train_devices if d.process_index == here]
  if rollout_devices is None:
    return Meshes(mesh, mesh)
  rollout = sharding.make_mesh(
    sharding.MeshConfig(1, -1, 1), devices=rollout_devices
  )
  return Meshes(mesh, rollout)


# ------------------------------------------------------------ learner


def build_learner(
  run: run_lib.RunConfig, policy: Policy, mesh: jax.sharding.Mesh
) -> tuple[TrainState, Steps]:
  """The initial `TrainState` (policy, optimizer, KL controller, RNG and,
  when enabled, the critic) and the run's compiled `Steps`."""
  t = run.train
  updates = t.num_steps * t.ppo_epochs * t.mini_batches
  tx, schedule = make_optimizer(run.optim, run.optim.learning_rate, updates)
  params, frozen = nnx.state(policy.module), None
  if run.lora.enabled:  # train (and optimise) the adapters only
    params, frozen = split_adapter(params)
  critic_params = critic_opt = critic_tx = critic_graphdef = None
  if run.critic.enabled:
    cfg, seed = policy.config, run.model.init_seed + 1
    critic = sharding.init_sharded(
      lambda: ValueModel(cfg, rngs=nnx.Rngs(seed)), mesh
    )
    critic_graphdef, critic_params = nnx.split(critic)
    critic_tx, _ = make_optimizer(run.optim, run.critic.learning_rate, updates)
  kl_cfg = run.algorithm.kl_in_reward
  kl_ctrl = (
    rewards.init_kl_controller(kl_cfg)
    if kl_cfg is not None
    else rewards.KLControllerState(coef=jnp.zeros((), jnp.float32))
  )
  opt_state = init_optimizer(tx, params, mesh)
  if critic_params is not None:
    critic_opt = init_optimizer(critic_tx, critic_params, mesh)
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  state = TrainState(
    params=params,
    opt_state=opt_state,
    kl_ctrl=jax.device_put(kl_ctrl, rep),
    rng=jax.device_put(jax.random.PRNGKey(t.seed), rep),
    updates=jax.device_put(jnp.zeros((), jnp.int32), rep),
    critic_params=critic_params,
    critic_opt_state=critic_opt,
    frozen=frozen,
  )
  steps = Steps(
    run,
    policy.graphdef,
    tx,
    schedule,
    critic_graphdef=critic_graphdef,
    critic_tx=critic_tx,
    state_shardings=jax.tree.map(lambda x: x.sharding, state),
    routing=routing_shape(policy.config),
  )
  return state, steps


# ---------------------------------------------------------------- data


@dataclasses.dataclass
class Prompts:
  """The RL prompt stream, the SFT one and this process's held-out share."""

  loader: data.PromptLoader
  sft_loader: data.PromptLoader
  eval_examples: list[Example]


def build_prompts(
  run: run_lib.RunConfig, encode: Callable[[str], Sequence[int]]
) -> Prompts:
  d = run.data
  source = data.make_source(d)
  index, count = jax.process_index(), jax.process_count()
  local = dict(process_index=index, process_count=count, shuffle=d.shuffle)
  loader = data.PromptLoader(
    source,
    batch_size=run.rollout.prompts_per_step,
    seed=run.train.seed,
    **local,
  )
  # SFT draws from its own stream (seed + 1) so the RL data order does
  # not depend on the number of warm-up steps.
  sft_loader = data.PromptLoader(
    source,
    batch_size=run.train.sft_batch_size,
    seed=run.train.seed + 1,
    **local,
  )
  # Held-out prompts: data.make_eval_source, else the first training ones.
  eval_source = data.make_eval_source(d) or source
  # Every prompt tokenized and length-checked now, not when drawn hours in.
  for src in {id(source): source, id(eval_source): eval_source}.values():
    prompt_check.check_prompts(
      src,
      encode,
      template=d.prompt_template,
      max_prompt_length=run.rollout.max_prompt_length,
    )
  n = min(run.train.eval_prompts, len(eval_source))
  n -= n % count
  share = n // max(count, 1)
  lo = index * share
  return Prompts(
    loader, sft_loader, [eval_source[i] for i in range(lo, lo + share)]
  )
