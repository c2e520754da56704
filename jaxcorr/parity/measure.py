"""Engine μ and trainer π_old on the same rows, through the run's own code.

`measure(config)` builds the run's `Trainer` (read-only, in a scratch
directory) and, exactly as step 0 of `jaxcorr.main` would after the SFT
warm-up (`train.sft_steps`; a pretrained model has none):

1. (a LoRA run: draws its adapters' B at random, `trained_adapter`)
   publishes the weights to the engine (`Trainer.engine_params`) and
   samples one batch of `rollout.prompts_per_step` prompts with the real
   `RolloutStage` (the JetStream-backed `PolicyEngine`, multi-turn
   trajectories when `config.agent` is on): μ per response token;
2. assembles it like `RLStep` (`assemble`, `to_device`, `pack`) and runs
   the compiled `Steps.prepare`: π_old of the same tokens, by whatever
   path the run takes (quantization-matched weights, R2 / R3 routing
   replay, exact mode, packed rows);
3. decodes the same prompts greedily (top-k 1: each token is argmax μ)
   and takes argmax π_old at every one of those positions from the
   trainer's forward (`argmax_logits`, with the engine's routing under
   R3).

A bypass preset (π_old := μ) is refused; nothing is trained after the
warm-up.
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from jaxcorr.train import batch as batch_lib
from jaxcorr.train import build, scoring
from jaxcorr.train.loop import Trainer
from jaxcorr.train.packing import forward as packed_forward
from jaxcorr.train.run_config import RunConfig


@dataclasses.dataclass
class Measured:
  """What `parity_bands` reads, numpy on the host.

  pi, mu: [B, T] float32 π_old and μ of the sampled tokens; mask: [B, T]
  bool, the response tokens that train. argmax_pi, argmax_mu: [B', T']
  int32 on the greedy rows (argmax_mu: the greedy tokens); argmax_mask:
  their response tokens. seconds: the wall time of the measurement."""

  pi: np.ndarray
  mu: np.ndarray
  mask: np.ndarray
  argmax_pi: np.ndarray
  argmax_mu: np.ndarray
  argmax_mask: np.ndarray
  seconds: float = 0.0


def argmax_logits(
  run: RunConfig, graphdef: Any, params: Any, batch: batch_lib.TrainBatch
) -> jax.Array:
  """argmax_v of the trainer's logits predicting each response token,
  `[B, T]` int32: the forward of `scoring.response_logp` (segments, and
  the routing `scoring.replay_experts` picks for an MoE policy)."""
  model = nnx.merge(graphdef, params)
  replay = scoring.replay_experts(run, batch)
  hidden, _, _ = model.routed_hidden_states(
    batch.tokens, segment_ids=batch.segment_ids, replay=replay
  )
  logits = scoring.at_response(model.logits(hidden), batch)
  return jnp.argmax(logits, axis=-1).astype(jnp.int32)


LORA_B_STD = 0.02
"""The std of the random `lora_b` a LoRA run is measured with (`trained_
adapter`): nnx.LoRA starts B at 0, where the adapter adds exactly 0 on
both sides and the row would be its base's."""


def trained_adapter(state: Any, seed: int = 0) -> Any:
  """A LoRA `TrainState` with every `lora_b` drawn from N(0, LORA_B_STD²)
  (what an adapter looks like after training), A kept: the engine then
  merges (or applies) a nonzero update, as it does from step 1 on."""
  flat = dict(nnx.to_flat_state(state.params))
  key = jax.random.key(seed)
  for i, (path, var) in enumerate(sorted(flat.items())):
    if path[-1] == 'lora_b':
      x = var.get_value()
      noise = jax.random.normal(jax.random.fold_in(key, i), x.shape)
      flat[path] = var.replace((LORA_B_STD * noise).astype(x.dtype))
  return state.replace(params=nnx.from_flat_state(flat))


def _prepared(trainer: Trainer, scored: Any) -> batch_lib.TrainBatch:
  """`RLStep`'s host side and `Steps.prepare` on `scored` (step 0)."""
  rl, state = trainer.rl_step, trainer.state
  batch = rl.assemble(scored, 0)
  device_batch = batch_lib.to_device(trainer.mesh, batch)
  packed = None
  if trainer.run.train.packing:
    packed = rl.pack(batch, device_batch, 0)
  ref = state.policy_params(state.params) if trainer.run.needs_ref else None
  with jax.set_mesh(trainer.mesh):
    if packed is not None:
      packed = packed_forward.to_device(trainer.mesh, packed)
    _, out, _ = rl.steps.prepare(
      state.policy_params(),
      state.critic_params,
      state.kl_ctrl,
      ref,
      device_batch,
      packed,
      light=True,
    )
  return out


def _greedy_argmax(trainer: Trainer, examples: Any) -> tuple[np.ndarray, ...]:
  """(argmax π_old, argmax μ, mask) on a greedy decode of `examples`."""
  greedy = trainer.stage.run_step(examples, step=0, greedy=True)
  batch = trainer.rl_step.assemble(greedy, 0)
  device_batch = batch_lib.to_device(trainer.mesh, batch)
  fn = jax.jit(functools.partial(argmax_logits, trainer.run, trainer.graphdef))
  with jax.set_mesh(trainer.mesh):
    ids = fn(trainer.state.policy_params(), device_batch.for_scoring())
  t = batch.response_mask.shape[1]
  tokens = np.asarray(batch.tokens)[:, -t:]
  return np.asarray(ids), tokens, np.asarray(batch.response_mask, bool)


def measure(
  config: ml_collections.ConfigDict, workdir: str | None = None
) -> Measured:
  """The module docstring's three passes for `config` (a ConfigDict);
  `workdir`: where the scratch run directory goes (default: $TMPDIR)."""
  t0 = time.perf_counter()
  run = build.build(config)
  if not run.decoupled:
    raise ValueError(
      "config.correction.mode='bypass' sets π_old := μ, nothing to compare: "
      "use 'decoupled' (any decoupled preset)"
    )
  with tempfile.TemporaryDirectory(dir=workdir) as scratch:
    trainer = Trainer(run, scratch, config=config, read_only=True)
    try:
      if run.train.sft_steps:
        trainer.run_sft()
      if run.lora.rank:
        trainer.state = trained_adapter(trainer.state)
      trainer.engine.update_params(trainer.engine_params(), version=0)
      examples = trainer.loader.next_batch()
      scored = trainer.stage.run_step(examples, step=0)
      prepared = _prepared(trainer, scored)
      argmax_pi, argmax_mu, argmax_mask = _greedy_argmax(trainer, examples)
    finally:
      trainer.close()
  return Measured(
    pi=np.asarray(prepared.old_logp, np.float32),
    mu=np.asarray(prepared.rollout_logp, np.float32),
    mask=np.asarray(prepared.response_mask, bool),
    argmax_pi=argmax_pi,
    argmax_mu=argmax_mu,
    argmax_mask=argmax_mask,
    seconds=time.perf_counter() - t0,
  )
