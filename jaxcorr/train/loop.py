"""The host loop: set-up, SFT warm-up, RL steps, evaluation, checkpoints.

    build(config) ─ mesh(es) ─ policy (+ reference, critic) ─ optimizer
      ─ JetStream engine ─ data ─ rewards ─ checkpointer ─ metric writer
    [restore the latest checkpoint of --workdir, if any]
    SFT warm-up (train.sft_steps, cross-entropy) ─ checkpoint 0
    for step s in [start, train.num_steps):
        rollouts (sync: current weights; async: producer, version s − lag)
        validate ─ assemble (drop, pad) ─ device
        prepare (old/ref log-probs, values, KL in reward, advantages,
                 decoupled correction) ─ update (epochs x mini x micro)
        weight sync to the engine ─ metrics ─ eval ─ checkpoint
    final checkpoint and evaluation

Versions: the engine's policy version is the number of RL steps whose
update produced its weights, so the trainer version at step s is s and a
row's staleness is s minus its sampling version (contract §6).

SIGTERM (TPU preemption) sets a flag; the loop finishes the current step,
writes a checkpoint and returns. A restart with the same --workdir resumes:
in sync mode the resumed run is bit-identical to an uninterrupted one
(params, metrics), because every random choice is derived from
(train.seed, step) or from checkpointed state.
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from etils import epath
from flax import nnx

from jaxcorr import sharding
from jaxcorr.losses import rewards
from jaxcorr.model import Transformer, TransformerConfig, load_hf
from jaxcorr.rollout.engine import PolicyEngine
from jaxcorr.rollout.validate import ValidationConfig, validate_rollout_batch
from jaxcorr.train import batch as batch_lib
from jaxcorr.train import checkpoint, data, metrics, preemption, text
from jaxcorr.train import run_config as run_lib
from jaxcorr.train.async_rollout import AsyncRollouts
from jaxcorr.train.critic import ValueModel, init_from_policy
from jaxcorr.train.reward_fns import RewardScorer, parse_spec
from jaxcorr.train.rollout_stage import RolloutStage, Scored
from jaxcorr.train.step import SFTStep, Steps, TrainState, make_optimizer


def model_config(run: run_lib.RunConfig) -> TransformerConfig:
  """The scratch model's `TransformerConfig` (HF models bring their own)."""
  m = run.model
  return TransformerConfig(
    vocab_size=m.vocab_size,
    hidden_size=m.hidden_size,
    intermediate_size=m.intermediate_size,
    num_layers=m.num_layers,
    num_heads=m.num_heads,
    num_kv_heads=m.num_kv_heads,
    tie_embeddings=m.tie_embeddings,
    rope_theta=m.rope_theta,
    max_position_embeddings=m.max_position_embeddings,
    initializer_range=m.initializer_range,
    dtype=m.dtype,
    param_dtype=m.param_dtype,
    remat=m.remat,
    scan_layers=m.scan_layers,
  )


def split_devices(
  run: run_lib.RunConfig, devices: list[Any]
) -> tuple[list[Any], list[Any] | None]:
  """(trainer devices, rollout devices or None = shared)."""
  k = run.rollout.rollout_devices if run.rollout.mode == 'async' else 0
  if k == 0:
    return devices, None
  if k >= len(devices):
    raise ValueError(
      f'config.rollout.rollout_devices={k}: must leave the trainer at least '
      f'one of the {len(devices)} devices'
    )
  return devices[:-k], devices[-k:]


def _copy_tree(tree: Any) -> Any:
  return jax.tree.map(jnp.copy, tree)


_copy = jax.jit(_copy_tree)


def fake_quant_int8(x: jax.Array) -> jax.Array:
  """Per-row symmetric int8 quantise + dequantise of a weight matrix
  (vectors such as norm scales and biases stay exact)."""
  if x.ndim < 2 or not jnp.issubdtype(x.dtype, jnp.floating):
    return jnp.copy(x)
  scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0
  scale = jnp.where(scale > 0, scale, 1.0)
  return (jnp.clip(jnp.round(x / scale), -127, 127) * scale).astype(x.dtype)


_quantize = jax.jit(lambda tree: jax.tree.map(fake_quant_int8, tree))


class Trainer:
  """One run of `jaxcorr.main` (see the module docstring).

  Args:
    config: the locked ConfigDict (task config + preset + overrides).
    workdir: checkpoints, metrics.jsonl and TensorBoard files.
    config_name: the config string, recorded in checkpoints and logs.
    read_only: build and restore only (export): write no config, metrics
      or checkpoints.
  """

  def __init__(
    self,
    config: ml_collections.ConfigDict,
    workdir: str,
    *,
    config_name: str = '',
    read_only: bool = False,
  ):
    self.run = run = run_lib.build(config)
    self.workdir = workdir
    self.config_name = config_name
    self.process_index = jax.process_index()
    self.process_count = jax.process_count()
    primary = self.process_index == 0 and not read_only
    if primary:
      # epath: a gs:// workdir (TPU pods) gets the file next to the
      # checkpoints; os.makedirs would make a local 'gs:' directory.
      path = epath.Path(workdir)
      path.mkdir(parents=True, exist_ok=True)
      # Every override applied: what `jaxcorr.export` rebuilds the run from.
      (path / 'config.json').write_text(config.to_json(indent=2))
    if self.process_count > 1 and run.rollout.rollout_devices:
      raise ValueError(
        'config.rollout.rollout_devices must be 0 with several processes: '
        'each host samples on its own devices (sub-meshes per host are not '
        'implemented yet)'
      )
    train_devices, rollout_devices = split_devices(run, jax.devices())
    self.mesh = sharding.make_mesh(run.mesh, devices=train_devices)
    if rollout_devices is None and self.process_count > 1:
      # Each host samples its own prompts, so its engine must run on its
      # own devices: a global engine mesh would need every host to issue
      # the same prefill/decode sequence.
      rollout_devices = [
        d for d in train_devices if d.process_index == self.process_index
      ]
    self.rollout_mesh = (
      self.mesh
      if rollout_devices is None
      else sharding.make_mesh(
        sharding.MeshConfig(1, -1, 1), devices=rollout_devices
      )
    )
    self.batch_shards = self.mesh.shape['data'] * self.mesh.shape['fsdp']
    self._build_model()
    self.tokenizer = text.make_tokenizer(run.model.hf_path, self.model_cfg)
    if self.tokenizer.vocab_size > self.model_cfg.vocab_size:
      raise ValueError(
        f'config.model.vocab_size={self.model_cfg.vocab_size} is smaller '
        f'than the tokenizer vocabulary ({self.tokenizer.vocab_size})'
      )
    self._build_state()
    self._build_data()
    self.scorer = RewardScorer(
      parse_spec(run.reward.functions), timeout_s=run.reward.timeout_s
    )
    self.engine = self._engine(self.rollout_mesh)
    self.stage = RolloutStage(run, self.engine, self.tokenizer, self.scorer)
    # Async mode: the producer owns its engine, so evaluation (trainer
    # thread, current weights) gets its own on the trainer's devices.
    self.eval_stage = self.stage
    if run.rollout.mode == 'async':
      self.eval_stage = RolloutStage(
        run, self._engine(self.mesh), self.tokenizer, self.scorer
      )
    self.checkpointer = checkpoint.Checkpointer(
      os.path.join(workdir, 'checkpoints'),
      every=run.train.checkpoint_every,
      keep=run.train.keep_checkpoints,
    )
    self.writer = metrics.MetricWriter(
      workdir, tensorboard=run.train.tensorboard, enabled=primary
    )
    self.step = 0
    self.sft_done = run.train.sft_steps == 0

  # ------------------------------------------------------------ set-up

  def _build_model(self) -> None:
    run = self.run
    if run.model.hf_path:
      self.policy = load_hf(
        run.model.hf_path,
        mesh=self.mesh,
        param_dtype=run.model.param_dtype,
        dtype=run.model.dtype,
        remat=run.model.remat,
        scan_layers=run.model.scan_layers,
      )
      self.model_cfg = self.policy.config
    else:
      self.model_cfg = model_config(run)
      cfg, seed = self.model_cfg, run.model.init_seed
      self.policy = sharding.init_sharded(
        lambda: Transformer(cfg, rngs=nnx.Rngs(seed)), self.mesh
      )
    self.graphdef, params = nnx.split(self.policy)
    self.param_shardings = sharding.param_shardings(params, self.mesh)

  def _build_state(self) -> None:
    run = self.run
    t = run.train
    updates = t.num_steps * t.ppo_epochs * t.mini_batches
    self.tx, schedule = make_optimizer(
      run.optim, run.optim.learning_rate, updates
    )
    params = nnx.state(self.policy)
    critic_params = critic_opt = critic_tx = critic_graphdef = None
    if run.critic.enabled:
      cfg = self.model_cfg
      critic = sharding.init_sharded(
        lambda: ValueModel(cfg, rngs=nnx.Rngs(run.model.init_seed + 1)),
        self.mesh,
      )
      critic_graphdef, critic_params = nnx.split(critic)
      self._critic_module = critic
      critic_tx, _ = make_optimizer(
        run.optim, run.critic.learning_rate, updates
      )
    self.critic_tx, self.critic_graphdef = critic_tx, critic_graphdef
    kl_cfg = run.algorithm.kl_in_reward
    kl_ctrl = (
      rewards.init_kl_controller(kl_cfg)
      if kl_cfg is not None
      else rewards.KLControllerState(coef=jnp.zeros((), jnp.float32))
    )
    with jax.set_mesh(self.mesh):
      opt_state = jax.jit(self.tx.init)(params)
      if critic_params is not None:
        critic_opt = jax.jit(critic_tx.init)(critic_params)
    rep = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    self.state = TrainState(
      params=params,
      opt_state=opt_state,
      kl_ctrl=jax.device_put(kl_ctrl, rep),
      rng=jax.device_put(jax.random.PRNGKey(run.train.seed), rep),
      updates=jax.device_put(jnp.zeros((), jnp.int32), rep),
      critic_params=critic_params,
      critic_opt_state=critic_opt,
    )
    self.ref_params = None
    shardings = jax.tree.map(lambda x: x.sharding, self.state)
    self.steps = Steps(
      run,
      self.graphdef,
      self.tx,
      schedule,
      critic_graphdef=critic_graphdef,
      critic_tx=critic_tx,
      state_shardings=shardings,
    )

  def _build_data(self) -> None:
    run = self.run
    d = run.data
    source = data.make_source(d)
    local_kw = dict(
      process_index=self.process_index, process_count=self.process_count
    )
    self.loader = data.PromptLoader(
      source,
      batch_size=run.rollout.prompts_per_step,
      seed=run.train.seed,
      shuffle=d.shuffle,
      **local_kw,
    )
    # SFT draws from its own stream (seed + 1) so the RL data order does
    # not depend on the number of warm-up steps.
    self.sft_loader = data.PromptLoader(
      source,
      batch_size=run.train.sft_batch_size,
      seed=run.train.seed + 1,
      shuffle=d.shuffle,
      **local_kw,
    )
    # Held-out prompts: data.make_eval_source, else the first training ones.
    eval_source = data.make_eval_source(d) or source
    n = min(run.train.eval_prompts, len(eval_source))
    n -= n % self.process_count
    share = n // max(self.process_count, 1)
    lo = self.process_index * share
    self.eval_examples = [eval_source[i] for i in range(lo, lo + share)]

  # ------------------------------------------------------------ helpers

  def _engine(self, mesh) -> PolicyEngine:
    r = self.run.rollout
    policy = self.policy
    if self.process_count > 1:
      # The policy's arrays span every host, the engine's mesh may not:
      # JAX cannot device_put across hosts, so start from host copies.
      policy = nnx.merge(self.graphdef, self.engine_params())
    return PolicyEngine(
      policy,
      max_concurrent_decodes=r.max_concurrent_decodes,
      decode_chunk=r.decode_chunk,
      max_prefill_length=r.max_prompt_length,
      max_target_length=r.max_prompt_length + r.max_new_tokens,
      mesh=mesh,
      dtype=jnp.dtype(r.engine_dtype),
    )

  def _row_multiple(self) -> int:
    t = self.run.train
    local_shards = max(self.batch_shards // self.process_count, 1)
    return t.mini_batches * t.micro_batches * local_shards

  def _to_device(self, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Process-local rows -> global arrays sharded over the batch axes."""
    out = {}
    for name, x in arrays.items():
      sh = sharding.batch_sharding(self.mesh, x.ndim)
      if self.process_count == 1:
        out[name] = jax.device_put(x, sh)
      else:
        out[name] = jax.make_array_from_process_local_data(sh, x)
    return out

  def _global_host(self, m: dict[str, float]) -> dict[str, float]:
    """Host metrics of this process's rows -> those of all rows, as one
    process would compute them (`metrics.combine_processes`; identity for
    one process). A collective: every process calls it with the same keys."""
    if self.process_count == 1 or not m:
      return m
    from jax.experimental import multihost_utils

    keys = sorted(m)
    # Gathered as raw bits: a float64 array would pass through JAX as
    # float32 (x64 is off).
    bits = np.asarray([m[k] for k in keys], np.float64).view(np.uint32)
    allv = np.asarray(multihost_utils.process_allgather(bits))
    allv = allv.reshape(self.process_count, -1).view(np.float64)
    combined = metrics.combine_processes(keys, allv)
    return {k: combined[k] for k in m}  # the order one process logs

  def engine_params(self) -> Any:
    """A copy of the policy's weights for the engine (one that later
    donations cannot invalidate), int8-quantised if configured."""
    if self.run.rollout.engine_quant == 'int8':
      params = _quantize(self.state.params)
    else:
      params = _copy(self.state.params)
    if self.process_count > 1:
      # Each host's engine runs on its own devices: gather the full weights
      # (through the host; fine for the models a per-host engine can hold).
      from jax.experimental import multihost_utils

      params = multihost_utils.process_allgather(params, tiled=True)
    return params

  def _sync_weights(self) -> float:
    t0 = time.perf_counter()
    self.engine.update_params(self.engine_params(), version=self.step)
    return time.perf_counter() - t0

  def _state_meta(self) -> dict[str, Any]:
    return {
      'step': self.step,
      'sft_done': self.sft_done,
      'loader': self.loader.state(),
      'config': self.config_name,
      'process_count': self.process_count,
    }

  def save(self, *, force: bool = False) -> bool:
    tree = {'state': self.state, 'ref': self.ref_params}
    return self.checkpointer.save(
      self.step, tree, self._state_meta(), force=force
    )

  def restore(self, step: int | None = None) -> bool:
    """Restore checkpoint `step` (None: the latest); False if none."""
    if self.checkpointer.latest_step() is None:
      return False
    ref_like = self.state.params if self.run.needs_ref else None
    tree = {'state': self.state, 'ref': ref_like}
    abstract = checkpoint.abstract_like(tree)
    tree, meta = self.checkpointer.restore(abstract, step=step)
    self.state, self.ref_params = tree['state'], tree['ref']
    self.step = int(meta['step'])
    self.sft_done = bool(meta['sft_done'])
    self.loader.restore(meta['loader'])
    self.writer.truncate_after(self.step)
    logging.info('restored step %d from %s', self.step, self.workdir)
    return True

  # --------------------------------------------------------------- SFT

  def sft_batch(self, examples) -> dict[str, np.ndarray]:
    """prompt + answer + EOS rows, right-padded; the loss reads the answer
    and EOS positions."""
    r = self.run.rollout
    s = r.max_prompt_length + r.max_new_tokens
    b = len(examples)
    tokens = np.zeros((b, s), np.int32)
    loss_mask = np.zeros((b, s - 1), bool)
    seg = np.zeros((b, s), np.int32)
    prompts = self.stage.encode(examples)
    for i, (ex, p) in enumerate(zip(examples, prompts)):
      a = [*self.tokenizer.encode(ex.answer, bos=False), self.tokenizer.eos_id]
      a = a[: r.max_new_tokens]
      row = p + a
      tokens[i, : len(row)] = row
      loss_mask[i, len(p) - 1 : len(row) - 1] = True
      seg[i, : len(row)] = 1
    return {'tokens': tokens, 'segment_ids': seg, 'loss_mask': loss_mask}

  def run_sft(self) -> None:
    run = self.run
    n = run.train.sft_steps
    tx, _ = make_optimizer(run.optim, run.optim.sft_learning_rate, n)
    sft = SFTStep(
      self.graphdef,
      tx,
      chunk=run.model.logprob_chunk,
      param_shardings=self.param_shardings,
    )
    params = _copy(self.state.params)
    with jax.set_mesh(self.mesh):
      opt_state = jax.jit(tx.init)(params)
    progress = metrics.ProgressLine(n, keys=('sft/loss', 'sft/token_prob'))
    t_prev = time.perf_counter()
    for i in range(n):
      rows = self.sft_batch(self.sft_loader.next_batch())
      rows = batch_lib.pad_rows(
        rows, batch_lib.padded_size(len(rows['tokens']), self.batch_shards)
      )
      with jax.set_mesh(self.mesh):
        params, opt_state, m = sft.step(
          params, opt_state, self._to_device(rows)
        )
      if (i + 1) % 50 == 0 or i + 1 == n:
        host = metrics.to_host_scalars(m)
        now = time.perf_counter()
        progress.update(i + 1, host, (now - t_prev) / 50)
        t_prev = now
    self.state = self.state.replace(params=params)
    if self.run.critic.enabled:
      critic = nnx.merge(self.critic_graphdef, self.state.critic_params)
      init_from_policy(critic, nnx.merge(self.graphdef, params))
      self.state = self.state.replace(critic_params=nnx.state(critic))
    self.sft_done = True

  # ---------------------------------------------------------------- RL

  def _validation(self) -> ValidationConfig:
    r = self.run.rollout
    return ValidationConfig(
      vocab_size=self.model_cfg.vocab_size,
      temperature=r.temperature,
      top_k=r.top_k,
      top_p=r.top_p,
      min_p=r.min_p,
      samples_per_prompt=r.samples_per_prompt,
      needs_rollout_logp=True,
      logprob_mode=r.logprob_mode,
      allow_nonfinite_logp=r.allow_nonfinite_logp,
      trainer_version=self.step,
    )

  def train_on(self, scored: Scored) -> dict[str, float]:
    """One RL update on a scored batch; returns the step's metrics."""
    run = self.run
    r = run.rollout
    rb = scored.batch
    validate_rollout_batch(rb, self._validation())
    host = batch_lib.rollout_metrics(
      rb,
      scored.rewards,
      trainer_version=self.step,
      max_staleness=r.max_staleness,
    )
    errors = host['rollout/finish_error_fraction']
    if errors > r.max_error_fraction:
      raise RuntimeError(
        f'{errors:.1%} of the rollouts are ERROR rows > '
        f'config.rollout.max_error_fraction={r.max_error_fraction}'
      )
    staleness_max = host['rollout/staleness_max']
    if r.max_staleness is not None and staleness_max > r.max_staleness:
      # Rows above the bound are dropped by `assemble`; with the fixed-lag
      # producer this never happens, so it is worth a log line.
      logging.warning('staleness %d > max %d', staleness_max, r.max_staleness)
    arrays = batch_lib.assemble(
      rb,
      scored.rewards,
      trainer_version=self.step,
      max_staleness=r.max_staleness,
      logprob_mode=r.logprob_mode,
      row_multiple=self._row_multiple(),
    )
    local_rows = arrays['group_ids'].shape[0]
    arrays['group_ids'] = arrays['group_ids'] + self.process_index * local_rows
    t0 = time.perf_counter()
    with jax.set_mesh(self.mesh):
      dev = self._to_device(arrays)
      kl_ctrl, train_arrays, prep = self.steps.prepare(
        self.state.params,
        self.state.critic_params,
        self.state.kl_ctrl,
        self.ref_params,
        dev,
      )
      jax.block_until_ready(train_arrays)
      t1 = time.perf_counter()
      # Same shardings as the update's outputs (a no-op after the first
      # step), so the update compiles once.
      state = jax.device_put(
        self.state.replace(kl_ctrl=kl_ctrl), self.steps.state_shardings
      )
      self.state, upd = self.steps.update(state, train_arrays)
      device_metrics = metrics.to_host_scalars({**prep, **upd})
    t2 = time.perf_counter()
    tokens = int(np.asarray(rb.context_mask).sum())
    tokens += int(np.asarray(rb.prompt_mask).sum())
    host = self._global_host(
      {**scored.metrics, **host, 'perf/train_tokens': float(tokens)}
    )
    train_tokens = host.pop('perf/train_tokens')  # all processes' tokens
    out = {**host, **device_metrics}
    out['time/prepare'] = t1 - t0
    out['time/update'] = t2 - t1
    out['rollout/policy_version'] = float(scored.version)
    out['perf/train_tokens'] = train_tokens
    return out

  def _evaluate(self, out: dict[str, float]) -> None:
    """Greedy accuracy of the current weights on the held-out prompts, as
    the rollout engine runs them (its dtype and quantisation)."""
    if self.eval_stage is not self.stage:
      self.eval_stage.engine.update_params(
        self.engine_params(), version=self.step
      )
    ev = self.eval_stage.evaluate(self.eval_examples, step=10**9 + self.step)
    out.update(self._global_host(ev))

  def train(self) -> dict[str, float]:
    """Run (or resume) the whole job; returns the last step's metrics."""
    run = self.run
    t = run.train
    self.restore()
    if not self.sft_done:
      logging.info('SFT warm-up: %d steps', t.sft_steps)
      self.run_sft()
    if self.run.needs_ref and self.ref_params is None:
      self.ref_params = _copy(self.state.params)  # frozen: π after SFT
    if self.step == 0 and self.checkpointer.latest_step() is None:
      self.save(force=True)
    self._sync_weights()
    progress = metrics.ProgressLine(
      t.num_steps,
      keys=('reward/mean', 'eval/accuracy', 'rollout_corr/kl'),
      every=t.log_every,
    )
    producer = None
    if run.rollout.mode == 'async':
      producer = AsyncRollouts(
        self.stage,
        self.loader,
        start=self.step,
        num_steps=t.num_steps,
        lag=run.rollout.max_staleness,
        queue_size=run.rollout.queue_size,
        params=self.engine_params(),
      )
    last: dict[str, float] = {}
    try:
      with preemption.PreemptionGuard() as guard:
        if self.step == 0 and t.eval_every:
          last = {'step': 0}
          self._evaluate(last)
          self.writer.write(0, last)
        while self.step < t.num_steps:
          t_step = time.perf_counter()
          if producer is None:
            examples = self.loader.next_batch()
            scored = self.stage.run_step(examples, step=self.step)
            scored.loader_state = self.loader.state()
          else:
            scored = producer.get()
            # The loader the checkpoint records is the one that drew the
            # batch just trained on.
            self.loader.restore(scored.loader_state)
          out = self.train_on(scored)
          self.step += 1
          if producer is None:
            out['time/weight_sync'] = self._sync_weights()
          else:
            t0 = time.perf_counter()
            producer.publish(self.step, self.engine_params())
            out['time/publish'] = time.perf_counter() - t0
          if t.eval_every and (
            self.step % t.eval_every == 0 or self.step == t.num_steps
          ):
            self._evaluate(out)
          dt = time.perf_counter() - t_step
          out['time/step'] = dt
          out['perf/tokens_per_s'] = out['perf/train_tokens'] / dt
          self.writer.write(self.step, out)
          progress.update(self.step, out, dt)
          last = out
          stop = guard.should_stop()
          if (
            self.checkpointer.should_save(self.step)
            or self.step == t.num_steps
            or stop
          ):
            self.save(force=True)
          if stop:
            logging.warning('preemption: checkpoint at step %d', self.step)
            break
    finally:
      if producer is not None:
        producer.close()
      self.checkpointer.wait()
      self.writer.close()
    return last

  def close(self) -> None:
    self.checkpointer.close()
