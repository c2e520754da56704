"""The host loop of `jaxcorr.main`: the `Trainer` ties the run's parts
together (docs/architecture.md draws the data flow).

    config      build.py              ConfigDict -> RunConfig, checked once
    policy      policy.py             the policy model (scratch or HF)
    set-up      setup.py              meshes, TrainState + Steps, prompts
    engine      rollouts/stage.py     PolicyEngine, generate, rewards: Scored
    resume      checkpoints/resume.py the latest checkpoint of --workdir
    SFT         sft.py                warm-up (train.sft_steps) ─ checkpoint 0
    rollouts    rollouts/source.py    sync; fixed_lag.py, stream.py beside it
    RL step     rl_step.py            validate ─ assemble ─ prepare ─ update
    evaluation  evaluation.py         greedy accuracy, pass@k (evals/)
    metrics     tracker/metrics.py    metrics.jsonl, the loggers, progress

Versions: the engine's policy version is the number of RL steps whose
update produced its weights, so the trainer version at step s is s and a
row's staleness is s minus its sampling version
(docs/math/rollout_contract.md §6).

SIGTERM (TPU preemption) sets a flag; the loop finishes the current step,
writes a checkpoint and returns. A restart with the same --workdir resumes:
in sync and fixed-lag async mode the resumed run is bit-identical to an
uninterrupted one (params, metrics), because every random choice is
derived from (train.seed, step) or from checkpointed state (fixed lag: the
older weights its pipeline samples with, `RolloutSource.lagged`).
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from jaxcorr import rewards as reward_fns
from jaxcorr import sharding
from jaxcorr.data import text
from jaxcorr.judge import bind_policy_judges
from jaxcorr.rewards import RewardScorer
from jaxcorr.train import (
  build,
  compile_cache,
  evaluation,
  preemption,
  scoring,
  setup,
  sft,
)
from jaxcorr.train.checkpoints import workdir as workdir_lib
from jaxcorr.train.checkpoints.resume import Progress, RunCheckpoints
from jaxcorr.train.critic import init_from_policy
from jaxcorr.train.policy import build_policy
from jaxcorr.train.rl_step import RLStep
from jaxcorr.train.rollouts.source import RolloutSource, make_rollouts
from jaxcorr.train.rollouts.stage import RolloutStage, Scored, make_engine
from jaxcorr.train.rollouts.weights import engine_params, weight_sync
from jaxcorr.train.run_config import RunConfig
from jaxcorr.train.state import copy_tree
from jaxcorr.train.tracker import metrics, reduction, sinks, traces
from jaxcorr.train.tracker.profile import StepProfiler


def _metric_writer(
  run: RunConfig, workdir: str, config: ml_collections.ConfigDict, primary: bool
) -> metrics.MetricWriter:
  """metrics.jsonl and the loggers of `train.loggers` (process 0 only)."""
  if not primary:
    return metrics.MetricWriter(workdir, enabled=False)
  t = run.train
  opened = sinks.open_sinks(
    t.loggers,
    workdir,
    config=json.loads(config.to_json()),
    project=t.project,
    run_name=t.run_name,
    wandb_entity=t.wandb_entity,
    mlflow_tracking_uri=t.mlflow_tracking_uri,
  )
  return metrics.MetricWriter(workdir, sinks=opened)


def _tracer(
  run: RunConfig, graphdef: Any, workdir: str, tokenizer, names, primary: bool
) -> traces.Tracer | None:
  """`train.trace_every`'s traces (tracker/traces.py), or None (off)."""
  t = run.train
  if not t.trace_every:
    return None
  return traces.Tracer(
    every=t.trace_every,
    rows=t.trace_rows,
    seed=t.seed,
    writer=traces.TraceWriter(workdir, max_mb=t.trace_max_mb, enabled=primary),
    policy_logp=jax.jit(
      functools.partial(scoring.response_logp, run, graphdef)
    ),
    decode=tokenizer.decode,
    reward_names=names,
  )


class Trainer:
  """One run of `jaxcorr.main` (module docstring); from a ConfigDict
  (notebooks, benchmarks, tests): `Trainer.from_config(config, workdir)`.

  Args:
    run: the validated run, `jaxcorr.train.build.build(config)`; the
      Trainer does not check it again.
    workdir: checkpoints, metrics.jsonl, TensorBoard files and profiles.
    config: the locked ConfigDict `run` was built from: written to
      `workdir`/config.json, and compared with the saved one on resume.
    config_name: the config string, recorded in checkpoints and logs.
    read_only: build and restore only, writing nothing.
    allow_config_change: resume a workdir whose saved config differs
      (`jaxcorr.train.checkpoints.workdir`).
  """

  def __init__(
    self,
    run: RunConfig,
    workdir: str,
    *,
    config: ml_collections.ConfigDict,
    config_name: str = '',
    read_only: bool = False,
    allow_config_change: bool = False,
  ):
    self.run = run
    self.workdir = workdir
    self.process_count = jax.process_count()
    primary = jax.process_index() == 0 and not read_only
    # Lock + fingerprint before any write (config.json: train()), then the
    # compilation cache inside the workdir the claim has checked.
    self._claim = None
    if primary:
      self._claim = workdir_lib.claim(
        workdir, config, allow_change=allow_config_change
      )
    compile_cache.enable('' if read_only else run.train.compile_cache, workdir)
    meshes = setup.make_meshes(run)
    self.mesh, self.rollout_mesh = meshes.train, meshes.rollout
    policy = build_policy(run.model, self.mesh, run.lora)
    self.policy, self.model_cfg = policy.module, policy.config
    self.graphdef = policy.graphdef
    self.param_shardings = policy.param_shardings
    # () -> a copy of the policy's weights for the engine (weights.py).
    sync = weight_sync(run, policy)
    self.engine_params = lambda: sync(self.state)
    self.tokenizer = text.make_tokenizer(
      run.model.hf_path, self.model_cfg, run.data.tokenizer
    )
    self.state, self.steps = setup.build_learner(run, policy, self.mesh)
    self.ref_params = None
    prompts = setup.build_prompts(run, self.tokenizer.encode)
    self.loader, self.sft_loader = prompts.loader, prompts.sft_loader
    self.scorer = scorer = RewardScorer.from_config(run.reward)
    scorer.start()
    self.engine = self._engine(self.rollout_mesh)
    bind_policy_judges(scorer.names, self.engine, self.tokenizer, run.rollout)
    self.stage = RolloutStage(run, self.engine, self.tokenizer, scorer)
    # Async and stream modes: the producer owns its engine, so evaluation
    # (trainer thread, current weights) gets its own on the trainer's
    # devices.
    eval_stage, weights = self.stage, None
    if run.rollout.mode != 'sync':
      engine = self._engine(self.mesh)
      eval_stage = RolloutStage(run, engine, self.tokenizer, scorer)
      weights = self.engine_params
    out = None if read_only else workdir  # the eval samples' JSONL
    self.evaluate = evaluation.build_evaluator(
      eval_stage, prompts.eval_examples, weights, workdir=out
    )
    self.rl_step = RLStep(
      run,
      self.steps,
      self.mesh,
      vocab_size=self.model_cfg.vocab_size,
      batch_shards=meshes.batch_shards,
      tracer=_tracer(
        run, self.graphdef, workdir, self.tokenizer, scorer.names, primary
      ),
    )
    self.batch_shards = meshes.batch_shards
    self.checkpoints = RunCheckpoints(
      workdir, run, config_name, config=config, allow_change=allow_config_change
    )
    self.checkpointer = self.checkpoints.checkpointer
    self.writer = _metric_writer(run, workdir, config, primary)
    self.step = 0
    self.profiler = StepProfiler(run.train.profile_steps, workdir)
    self.sft_done = run.train.sft_steps == 0
    self.preempted = False  # train() stopped on SIGTERM / Ctrl-C
    self._loader_state = self.loader.state()
    self.source: RolloutSource | None = None  # train()'s
    self._lagged: dict[int, Any] = {}  # restored for the source

  @classmethod
  def from_config(cls, config, workdir: str, **kwargs: Any) -> Trainer:
    """Builds and validates `config` (a ConfigDict) once, then the Trainer."""
    return cls(build.build(config), workdir, config=config, **kwargs)

  def _engine(self, mesh: jax.sharding.Mesh) -> Any:
    policy = self.policy
    if self.process_count > 1:
      # The policy's arrays span every host, the engine's mesh may not:
      # JAX cannot device_put across hosts, so start from host copies.
      whole = engine_params(self.run, self.state.policy_params())
      policy = nnx.merge(self.graphdef, whole)
    # Rows are never split in the engine: mesh.sequence folds into fsdp.
    return make_engine(self.run, policy, sharding.engine_mesh(mesh))

  def save(self, *, force: bool = False) -> bool:
    lagged = self.source.lagged(self.step) if self.source else {}
    progress = Progress(self.step, self.sft_done, self._loader_state, lagged)
    return self.checkpoints.save(
      progress, self.state, self.ref_params, force=force
    )

  def restore(self, step: int | None = None) -> bool:
    """Restore checkpoint `step` (None: the latest); False if none."""
    restored = self.checkpoints.restore(self.state, step)
    if restored is None:
      return False
    self.state, self.ref_params, progress = restored
    self.step, self.sft_done = progress.step, progress.sft_done
    self.loader.restore(progress.loader_state)
    self._loader_state = progress.loader_state
    self._lagged = progress.lagged  # for the producer (fixed_lag.py)
    logging.info('restored step %d from %s', self.step, self.workdir)
    return True

  def run_sft(self) -> None:
    """The SFT warm-up (`sft.py`); a critic starts from its result."""
    run = self.run
    params = sft.run_sft(
      run,
      self.graphdef,
      self.state.params,
      loader=self.sft_loader,
      rows=sft.rows_of(run, self.tokenizer, self.stage),
      mesh=self.mesh,
      batch_shards=self.batch_shards,
      param_shardings=self.param_shardings,
    )
    self.state = self.state.replace(params=params)
    if run.critic.enabled:
      critic = nnx.merge(self.steps.critic_graphdef, self.state.critic_params)
      init_from_policy(critic, nnx.merge(self.graphdef, params))
      # init_from_policy copies: the update donates both param trees.
      self.state = self.state.replace(critic_params=nnx.state(critic))
    self.sft_done = True

  def train_on(self, scored: Scored) -> dict[str, float]:
    """One RL update on a scored batch (`rl_step.py`); the step's metrics.
    The caller advances `step`."""
    # Cast and checked in the update's dtype: 1e39 is finite in float64
    # and inf in float32; the error must name the rewards.
    scored.rewards = reward_fns.check_rewards(scored.rewards, np.float32)
    self.state, out = self.rl_step(
      self.state, self.ref_params, scored, self.step
    )
    self._loader_state = scored.loader_state
    return out

  def _warm_up(self) -> None:
    """SFT if not done, the frozen reference (π after SFT), checkpoint 0."""
    if not self.sft_done:
      logging.info('SFT warm-up: %d steps', self.run.train.sft_steps)
      self.run_sft()
    if self.run.needs_ref and self.ref_params is None:
      self.ref_params = copy_tree(self.state.params)
    if self.step == 0 and self.checkpointer.latest_step() is None:
      self.save(force=True)

  def _rl_step(
    self, source: RolloutSource, progress: metrics.ProgressLine
  ) -> dict[str, float]:
    """Step `self.step`: rollouts, update, weights to the rollouts, eval,
    metrics. Returns what it wrote."""
    t = self.run.train
    t_step = time.perf_counter()
    with self.profiler.step(self.step + 1):
      out = self.train_on(source.next())
      self.step += 1
      out.update(reduction.values(source.publish(self.step)))
    if t.eval_every and (
      self.step % t.eval_every == 0 or self.step == t.num_steps
    ):
      out.update(self.evaluate(self.step))
    dt = time.perf_counter() - t_step
    out['time/step'] = dt
    out['perf/tokens_per_s'] = out['perf/train_tokens'] / dt
    self.writer.write(self.step, out)
    progress.update(self.step, out, dt)
    return out

  def train(self) -> dict[str, float]:
    """Run (or resume) the whole job; returns the last step's metrics."""
    t = self.run.train
    try:
      self.restore()
    except BaseException:  # a refused resume frees the workdir at once
      self.close()
      raise
    self.writer.resume(self.step)
    if self.rl_step.tracer is not None:
      self.rl_step.tracer.writer.resume(self.step)
    if self._claim is not None:  # after a successful restore or none
      self._claim.write_config()
    self._warm_up()
    progress = metrics.ProgressLine(
      t.num_steps,
      # k3, not the signed kl: the gap (the signed one can grow as it shrinks)
      keys=('reward/mean', 'eval/accuracy', 'rollout_corr/k3_kl'),
      every=t.log_every,
    )
    self.source = source = make_rollouts(
      self.run,
      self.stage,
      self.loader,
      self.engine_params,
      start=self.step,
      history=self._lagged,
    )
    last: dict[str, float] = {}
    try:
      # Ctrl-C checkpoints like SIGTERM (a second one interrupts at once).
      with preemption.PreemptionGuard(catch_sigint=True) as guard:
        # A stop cuts short a reward call that hangs (scorer.py).
        self.scorer.stop_requested = lambda: guard.requested
        if self.step == 0 and t.eval_every and t.eval_at_start:
          last = {'step': 0, **self.evaluate(0)}
          self.writer.write(0, last)
        while self.step < t.num_steps:
          last = self._rl_step(source, progress)
          stop = guard.should_stop()
          if (
            self.checkpointer.should_save(self.step)
            or self.step == t.num_steps
            or stop
          ):
            self.save(force=True)
          if stop:
            logging.warning('preemption: checkpoint at step %d', self.step)
            self.preempted = True
            break
    finally:
      self.scorer.stop_requested = None
      source.close()
      self.checkpointer.wait()
      self.writer.close()
      if self._claim is not None:
        self._claim.release()
    return last

  def close(self) -> None:
    self.checkpoints.close()
    self.scorer.close()
    if self._claim is not None:
      self._claim.release()
