"""The run's static configuration: `RunConfig`, and the trainer's own
sections (start-up).

`RunConfig` holds one frozen dataclass per config section; it is hashable,
a jit static argument, and every trainer module reads the run through it.
Each section is declared beside what it configures (`ModelConfig` in
jaxcorr/train/policy.py, `DataConfig` in jaxcorr/data/config.py,
`RolloutConfig` in jaxcorr/train/rollouts/config.py, `RewardConfig` in
jaxcorr/rewards/config.py, `OptimConfig` in jaxcorr/train/state.py,
`CriticConfig` in jaxcorr/train/critic.py, the loss and correction configs in
jaxcorr/losses/, `MeshConfig` in jaxcorr/sharding.py, `EvalConfig` in
jaxcorr/train/evals/config.py, `AgentConfig` in jaxcorr/agents/config.py).
The two declared here are read across the whole trainer: `TrainConfig` (steps, batch geometry,
evaluation, checkpoints, logging: the loop, the step, SFT, checkpoints) and
`AlgorithmConfig` (advantages and KL in reward: set-up and prepare); every
module that reads them also reads `RunConfig`, so they live with it.

`jaxcorr.train.build.build` is the one way from a ConfigDict to a
`RunConfig`: it builds every section, checks the combinations that only make
sense together, and runs the components' start-up checks. To add a trainer
field, add one `setting` to the dataclass of its section (and read it where
it is used); configs, validation and the error message follow.
"""

from __future__ import annotations

import dataclasses

from jaxcorr.agents.config import AgentConfig
from jaxcorr.config.fields import (
  boolean,
  canonical,
  integer,
  setting,
  text,
  validate,
)
from jaxcorr.data.config import DataConfig
from jaxcorr.losses import kl as kl_lib
from jaxcorr.losses.advantages import AdvantageConfig
from jaxcorr.losses.objective_config import LossConfigs
from jaxcorr.losses.rewards import KLControlConfig
from jaxcorr.model.lora import LoraConfig
from jaxcorr.rewards import RewardConfig
from jaxcorr.rollout.speculative_config import SpeculativeConfig
from jaxcorr.sharding import MeshConfig
from jaxcorr.train.critic import CriticConfig
from jaxcorr.train.distill import DistillConfig
from jaxcorr.train.evals.config import EvalConfig
from jaxcorr.train.policy import ModelConfig
from jaxcorr.train.rollouts.config import RolloutConfig
from jaxcorr.train.rollouts.dynamic_sampling import DynamicSamplingConfig
from jaxcorr.train.routing.config import MoEConfig
from jaxcorr.train.state import OptimConfig
from jaxcorr.train.tracker import profile, sinks

_POS, _NAT = integer(1), integer(0)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Steps, batch geometry, evaluation, checkpoints and logging."""

  num_steps: int = setting(100, _NAT, 'RL steps (one rollout batch each).')
  sft_steps: int = setting(
    0,
    _NAT,
    'Supervised warm-up steps (cross-entropy on prompt -> answer) before RL.',
  )
  sft_batch_size: int = setting(64, _POS, 'Sequences per SFT step.')
  ppo_epochs: int = setting(1, _POS, 'Passes over each rollout batch.')
  mini_batches: int = setting(
    1, _POS, 'Optimizer updates per epoch (the batch is split into this many).'
  )
  micro_batches: int = setting(
    1, _POS, 'Gradient-accumulation chunks per mini-batch (global divisors).'
  )
  shuffle_minibatches: bool = setting(
    True,
    boolean,
    'Shuffle rows before splitting into mini-batches (PRNG from train.seed).',
  )
  packing: bool = setting(
    False,
    boolean,
    "Pack each micro-batch's sequences (prompt + response) into rows of "
    'max_prompt_length + max_new_tokens tokens, micro-batches balanced by '
    'token count (jaxcorr/train/packing/layout.py; docs/training.md).',
  )
  metrics_every: int = setting(
    1,
    _POS,
    'Heavy diagnostics (rollout_corr/, actor/ beyond the loss terms) on '
    'every N-th RL step only; the update is the same on every step '
    '(jaxcorr/train/tracker/diagnostics.py).',
  )
  profile_steps: str = setting(
    '',
    profile.steps_rule,
    "RL steps (1-based, e.g. '3,5-6') to trace with jax.profiler into "
    "<workdir>/profile (TensorBoard / Perfetto; '': off).",
  )
  trace_every: int = setting(
    0,
    _NAT,
    'Keep per-token traces (μ, π_old, π_θ, weights, staleness, '
    'advantages) of train.trace_rows rows every N RL steps in '
    '<workdir>/traces (0: off; jaxcorr/train/tracker/traces.py).',
  )
  trace_rows: int = setting(4, _POS, 'Rows per trace step.')
  trace_max_mb: int = setting(
    256, _POS, 'Cap on <workdir>/traces: past it the oldest steps go.'
  )
  checkpoint_every: int = setting(
    50, _NAT, 'Save every N RL steps (0: only at the end and on SIGTERM).'
  )
  keep_checkpoints: int = setting(3, _POS, 'Checkpoints kept.')
  eval_every: int = setting(
    10,
    _NAT,
    'Greedy evaluation on held-out prompts every N RL steps (0: never); '
    'also before the first RL step and at the end.',
  )
  eval_prompts: int = setting(128, _NAT, 'Held-out prompts per evaluation.')
  eval_at_start: bool = setting(
    True,
    boolean,
    'With eval_every > 0: also evaluate before the first RL step (False: '
    'start training at once; the first evaluation is at step eval_every).',
  )
  compile_cache: str = setting(
    'workdir',
    text,
    "JAX's persistent compilation cache: 'workdir' (<workdir>/"
    "compile_cache), a directory shared by runs, or '' (off); a restarted "
    'run loads its compiled programs (jaxcorr/train/compile_cache.py).',
  )
  seed: int = setting(
    0, _NAT, 'Root seed: init, data order, sampling, mini-batch shuffles.'
  )
  loggers: str = setting(
    'tensorboard',
    sinks.loggers_rule,
    'Where metrics go besides metrics.jsonl (always written): a comma list '
    'of tensorboard, jsonl, wandb, mlflow; jsonl alone: no other logger '
    '(docs/evaluation.md).',
  )
  project: str = setting(
    'jaxcorr', text, 'The W&B project and the MLflow experiment.'
  )
  run_name: str = setting(
    '', text, "The W&B / MLflow run name ('': the workdir's basename)."
  )
  wandb_entity: str = setting(
    '', text, "The W&B entity (team or user; '': W&B's default)."
  )
  mlflow_tracking_uri: str = setting(
    '',
    text,
    "The MLflow tracking store ('': MLFLOW_TRACKING_URI, else a file "
    'store under <workdir>/mlruns).',
  )
  log_every: int = setting(1, _POS, 'Console progress line every N steps.')

  def __post_init__(self):
    validate(self)


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
  """Advantages and KL in reward; `config.algorithm` holds the
  `AdvantageConfig` fields, `kl_penalty` and the `kl_in_reward` section
  (`KLControlConfig` plus its `enabled` switch)."""

  advantage: AdvantageConfig = dataclasses.field(
    default_factory=AdvantageConfig
  )
  kl_in_reward: KLControlConfig | None = None
  kl_penalty: str = setting(
    'k1',
    canonical(kl_lib.canonical_estimator),
    'KL-in-reward estimator: kl (k1), abs, mse (k2), low_var_kl (k3), or '
    "any of them with a trailing + (its value, k2's gradient).",
  )

  def __post_init__(self):
    validate(self)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything static about a run (hashable: a jit static argument)."""

  losses: LossConfigs
  algorithm: AlgorithmConfig
  model: ModelConfig
  data: DataConfig
  rollout: RolloutConfig
  reward: RewardConfig
  train: TrainConfig
  optim: OptimConfig
  critic: CriticConfig
  mesh: MeshConfig
  eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
  agent: AgentConfig = dataclasses.field(default_factory=AgentConfig)
  lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
  moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
  dynamic_sampling: DynamicSamplingConfig = dataclasses.field(
    default_factory=DynamicSamplingConfig
  )
  distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
  speculative: SpeculativeConfig = dataclasses.field(
    default_factory=SpeculativeConfig
  )

  @property
  def needs_ref(self) -> bool:
    """A frozen reference policy is needed (ref-KL loss or KL in reward)."""
    return (
      self.losses.actor.kl_loss_coef != 0
      or self.algorithm.kl_in_reward is not None
    )

  @property
  def decoupled(self) -> bool:
    """π_old comes from a trainer forward pass (no correction or decoupled)."""
    corr = self.losses.correction
    return corr is None or corr.mode == 'decoupled'
