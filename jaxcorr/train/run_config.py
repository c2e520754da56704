"""The trainer's config sections, each field declared once (start-up).

`model`, `data`, `rollout`, `reward`, `train`, `optim`, `critic` and
`algorithm`: every field is a `setting` (default, rule, doc) of the frozen
dataclasses below. `configs/trainer.py` derives the ml-collections sections
from them (`jaxcorr.config.convert.section`) and
`jaxcorr.config.convert.build` turns a ConfigDict into the hashable
`RunConfig` (a jit static argument), checking every field there and the
combinations that only make sense together. To add a trainer field, add one
`setting` here (and read it where it is used); configs, validation and the
error message follow.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jaxcorr.config.fields import (
  boolean,
  canonical,
  fail,
  integer,
  number,
  one_of,
  setting,
  text,
  validate,
)
from jaxcorr.losses import aggregate as agg_lib
from jaxcorr.losses import kl as kl_lib
from jaxcorr.losses.advantages import AdvantageConfig
from jaxcorr.losses.rewards import KLControlConfig
from jaxcorr.train.rollouts.config import (
  DTYPES,
  RolloutConfig,
)

if TYPE_CHECKING:
  from jaxcorr.losses.objective_config import LossConfigs
  from jaxcorr.sharding import MeshConfig

_POS, _NAT = integer(1), integer(0)


def build(config):
  """`jaxcorr.config.convert.build` (the trainer's entry point)."""
  from jaxcorr.config import convert

  return convert.build(config)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The policy: a local Hugging Face checkpoint or a model from scratch.

  The shape fields (vocab_size ... initializer_range) build a scratch model
  and are ignored with `hf_path`; every field `TransformerConfig` shares is
  passed on by name (`jaxcorr.train.loop.model_config`).
  """

  hf_path: str = setting(
    '',
    text,
    'Local HF directory (config.json, *.safetensors, tokenizer.json); '
    "'' builds a randomly initialised model from the shape fields.",
  )
  vocab_size: int = setting(32, _POS, 'Scratch model: vocabulary size.')
  hidden_size: int = setting(128, _POS, 'Scratch model: width.')
  intermediate_size: int = setting(384, _POS, 'Scratch model: MLP width.')
  num_layers: int = setting(2, _POS, 'Scratch model: decoder layers.')
  num_heads: int = setting(4, _POS, 'Scratch model: query heads.')
  num_kv_heads: int = setting(2, _POS, 'Scratch model: KV heads (GQA).')
  tie_embeddings: bool = setting(
    True, boolean, 'Scratch model: the LM head reuses the embedding.'
  )
  rope_theta: float = setting(
    10_000.0, number(0, lo_open=True), 'Scratch model: RoPE base.'
  )
  max_position_embeddings: int = setting(
    512, _POS, 'Scratch model: longest sequence (prompt + response).'
  )
  initializer_range: float = setting(
    0.02, number(0, lo_open=True), 'Std of the random init (scratch models).'
  )
  dtype: str = setting(
    'float32',
    one_of(*DTYPES),
    'Trainer compute dtype; log-probs are always float32.',
  )
  param_dtype: str = setting(
    'float32', one_of(*DTYPES), 'Stored parameter dtype of the policy.'
  )
  remat: str = setting(
    'none', one_of('none', 'full', 'dots'), 'Activation checkpointing.'
  )
  scan_layers: bool = setting(
    False, boolean, 'Scan over layers (one layer compiled once; long models).'
  )
  logprob_chunk: int = setting(
    128, _POS, 'Positions per chunk of the chunked log-prob computation.'
  )
  init_seed: int = setting(0, _NAT, 'Seed of the random init.')

  def __post_init__(self):
    validate(self)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Prompts: the embedded arithmetic task or a local JSONL/Parquet file."""

  source: str = setting(
    'arithmetic',
    one_of('arithmetic', 'jsonl', 'parquet'),
    "'arithmetic' (generated, no files), 'jsonl' or 'parquet'.",
  )
  path: str = setting('', text, 'jsonl/parquet: the training file.')
  eval_path: str = setting(
    '',
    text,
    "jsonl/parquet: a held-out file for evaluation ('' takes eval prompts "
    'from the end of a generated task, or none for files).',
  )
  prompt_field: str = setting(
    'question', text, 'jsonl/parquet: the prompt field (GSM8K: question).'
  )
  answer_field: str = setting(
    'answer', text, 'jsonl/parquet: the answer field (GSM8K: answer).'
  )
  answer_format: str = setting(
    'gsm8k',
    one_of('gsm8k', 'raw'),
    "'gsm8k' (the answer after '####') or 'raw'.",
  )
  prompt_template: str = setting(
    '{prompt}', text, "Text around the prompt; must contain '{prompt}'."
  )
  shuffle: bool = setting(
    True,
    boolean,
    'Shuffle every epoch (deterministic from train.seed and the epoch).',
  )
  num_examples: int = setting(100_000, _POS, 'arithmetic: training examples.')
  seed: int = setting(0, _NAT, 'arithmetic: seed of the training examples.')
  max_operand: int = setting(99, _POS, 'arithmetic: largest operand.')
  ops: str = setting(
    '+', text, "arithmetic: the operators, a non-empty string of '+-*'."
  )
  eval_examples: int = setting(
    256, _NAT, 'arithmetic: held-out evaluation examples (seed + 1).'
  )

  def __post_init__(self):
    p = validate(self)
    if self.source != 'arithmetic' and not self.path:
      fail(f'{p}.path', self.path, f'a local {self.source} file')
    from jaxcorr.data import prompts as data
    from jaxcorr.data import tasks

    data.format_prompt(self.prompt_template, tasks.Example('', ''))
    if not self.ops or set(self.ops) - set('+-*'):
      fail(f'{p}.ops', self.ops, "a non-empty string of '+', '-', '*'")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """Reward functions of `jaxcorr.rewards`, by name."""

  functions: str = setting(
    'exact_match',
    text,
    "'name:weight,name:weight' (weight 1 when omitted): exact_match, "
    'math_answer, format, arith_exact, or any registered name.',
  )
  timeout_s: float = setting(
    5.0,
    number(0),
    'Seconds per call; a call that takes longer scores 0 (metric '
    'reward/timeouts). 0: no per-call limit (the step budget still '
    'applies).',
  )
  step_budget_s: float = setting(
    300.0,
    number(0),
    'Seconds all reward calls of one step may take; calls unfinished then '
    'score 0 (reward/timeouts, reward/budget_exceeded). 0: no budget.',
  )

  def __post_init__(self):
    validate(self)
    from jaxcorr import rewards as reward_fns

    reward_fns.RewardScorer(reward_fns.parse_spec(self.functions), timeout_s=0)


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
  seed: int = setting(
    0, _NAT, 'Root seed: init, data order, sampling, mini-batch shuffles.'
  )
  tensorboard: bool = setting(
    True, boolean, 'TensorBoard event files next to metrics.jsonl.'
  )
  log_every: int = setting(1, _POS, 'Console progress line every N steps.')

  def __post_init__(self):
    validate(self)


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


SECTIONS: dict[str, type] = {
  'model': ModelConfig,
  'data': DataConfig,
  'rollout': RolloutConfig,
  'reward': RewardConfig,
  'train': TrainConfig,
  'optim': OptimConfig,
  'critic': CriticConfig,
}
"""The trainer sections that map one ConfigDict section to one dataclass."""
