"""The run's device inputs as abstract arrays: shapes, dtypes and the
shardings a real run gives them, with no buffer allocated.

    abstract_learner  -> the `TrainState` `build_learner` would make, and
                         the run's real `Steps`
    abstract_batch    -> the `TrainBatch` `rl_step` hands to `prepare`
    abstract_engine   -> the engine's params and decode state on its mesh

Everything is a `jax.ShapeDtypeStruct` with its `sharding`, so
`jax.jit(...).lower(...)` partitions exactly as a run's first call does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcorr import sharding
from jaxcorr.losses import rewards
from jaxcorr.model import Transformer, TransformerConfig
from jaxcorr.rollout import decode
from jaxcorr.rollout.state import SamplingParams, pack_sampling
from jaxcorr.train.batch import TrainBatch, padded_size
from jaxcorr.train.critic import ValueModel
from jaxcorr.train.run_config import RunConfig
from jaxcorr.train.state import (
  TrainState,
  make_optimizer,
  optimizer_shardings,
)
from jaxcorr.train.step import Steps

Mesh = jax.sharding.Mesh


def _replicated(mesh: Mesh) -> jax.sharding.NamedSharding:
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def with_shardings(tree: Any, shardings: Any) -> Any:
  """Abstract leaves of `tree` (arrays or `ShapeDtypeStruct`s) placed by
  the matching leaves of `shardings`."""
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
    tree,
    shardings,
  )


def abstract_module(make: Any, mesh: Mesh) -> tuple[Any, Any]:
  """(graphdef, params) of the module `make()` builds, its params abstract
  and placed by the sharding rules (as `sharding.init_sharded` places the
  real ones)."""
  graphdef, state = nnx.split(nnx.eval_shape(make))
  return graphdef, with_shardings(state, sharding.param_shardings(state, mesh))


def _optimizer_state(tx: Any, params: Any, mesh: Mesh) -> Any:
  """The optimizer state `init_optimizer` makes, abstract."""
  shapes = jax.eval_shape(tx.init, params)
  return with_shardings(shapes, optimizer_shardings(tx, params, mesh))


@dataclasses.dataclass
class Learner:
  """The abstract `TrainState`, the reference params (None when the run
  needs none), the policy config and the run's real compiled-to-be
  `Steps`."""

  state: TrainState
  ref_params: Any
  config: TransformerConfig
  steps: Steps


def abstract_learner(
  run: RunConfig, cfg: TransformerConfig, mesh: Mesh
) -> Learner:
  """`jaxcorr.train.setup.build_learner`'s state and steps for a policy of
  config `cfg` on `mesh`, abstract (same optimizer, same shardings)."""
  t = run.train
  updates = t.num_steps * t.ppo_epochs * t.mini_batches
  tx, schedule = make_optimizer(run.optim, run.optim.learning_rate, updates)
  graphdef, params = abstract_module(
    lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh
  )
  critic = dict(critic_params=None, critic_opt_state=None)
  critic_graphdef = critic_tx = None
  if run.critic.enabled:
    critic_graphdef, critic_params = abstract_module(
      lambda: ValueModel(cfg, rngs=nnx.Rngs(1)), mesh
    )
    critic_tx, _ = make_optimizer(run.optim, run.critic.learning_rate, updates)
    critic = dict(
      critic_params=critic_params,
      critic_opt_state=_optimizer_state(critic_tx, critic_params, mesh),
    )
  rep = _replicated(mesh)
  scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
  state = TrainState(
    params=params,
    opt_state=_optimizer_state(tx, params, mesh),
    kl_ctrl=rewards.KLControllerState(coef=scalar),
    rng=jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep),
    updates=jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
    **critic,
  )
  steps = Steps(
    run,
    graphdef,
    tx,
    schedule,
    critic_graphdef=critic_graphdef,
    critic_tx=critic_tx,
    state_shardings=jax.tree.map(lambda x: x.sharding, state),
  )
  ref = params if run.needs_ref else None
  return Learner(state, ref, cfg, steps)


def batch_rows(run: RunConfig, batch_shards: int) -> int:
  """Rows of a step's global batch: prompts x samples, padded to a
  multiple of mini x micro batches x the batch shards (`rl_step`)."""
  t = run.train
  multiple = t.mini_batches * t.micro_batches * batch_shards
  return padded_size(run.rollout.batch_size, multiple)


def abstract_batch(run: RunConfig, mesh: Mesh) -> TrainBatch:
  """The host batch `rl_step` puts on `mesh` before `prepare`: the
  longest rows the config allows (prompt `max_prompt_length`, response
  `max_new_tokens`)."""
  r = run.rollout
  b = batch_rows(run, mesh.shape['data'] * mesh.shape['fsdp'])
  p, t = r.max_prompt_length, r.max_new_tokens
  i32, f32 = np.int32, np.float32
  fields = dict(
    tokens=((b, p + t), i32),
    segment_ids=((b, p + t), i32),
    response_mask=((b, t), np.bool_),
    rollout_logp=((b, t), f32),
    temperature=((b,), f32),
    top_k=((b,), i32),
    top_p=((b,), f32),
    min_p=((b,), f32),
    group_ids=((b,), i32),
    seq_reward=((b,), f32),
    version_gap=((b, t), i32),
  )
  if r.logprob_mode == 'replay':
    fields['kept_ids'] = ((b, t, r.kept_set_capacity), i32)
    fields['kept_count'] = ((b, t), i32)
  return TrainBatch(
    **{
      k: jax.ShapeDtypeStruct(
        shape, dtype, sharding=sharding.batch_sharding(mesh, len(shape))
      )
      for k, (shape, dtype) in fields.items()
    }
  )


@dataclasses.dataclass
class Engine:
  """The engine's abstract params and decode state, and its programs."""

  config: TransformerConfig
  params: Any
  state: Any
  stop_ids: jax.ShapeDtypeStruct
  programs: decode.Programs


def abstract_engine(run: RunConfig, cfg: TransformerConfig, mesh: Mesh):
  """What `rollout.stage.make_engine` builds on `mesh`, abstract: params
  in `rollout.engine_dtype` placed by the rules, the decode state of
  `max_concurrent_decodes` slots replicated (`Layout.empty_state`)."""
  r = run.rollout
  dtype = jnp.dtype(r.engine_dtype)
  ecfg = cfg.replace(dtype=dtype, param_dtype=dtype)
  graphdef, params = abstract_module(
    lambda: Transformer(ecfg, rngs=nnx.Rngs(0)), mesh
  )
  kept = (
    min(r.kept_set_capacity, cfg.vocab_size)
    if r.logprob_mode == 'replay'
    else 0
  )
  rep = _replicated(mesh)
  length = r.max_prompt_length + r.max_new_tokens
  state = jax.eval_shape(
    lambda: decode.init_state(
      ecfg, r.max_concurrent_decodes, length, pack_sampling(SamplingParams())
    )
  )
  state = with_shardings(state, jax.tree.map(lambda _: rep, state))
  stop = jax.ShapeDtypeStruct((4,), jnp.int32, sharding=rep)
  programs = decode.jit_programs(graphdef, kept, length if r.exact else 0)
  return Engine(ecfg, params, state, stop, programs)
