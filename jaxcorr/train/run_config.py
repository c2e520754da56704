"""The whole run's ConfigDict -> frozen, validated dataclasses (start-up).

`build(config)` is called once, before any device work: every field of every
section is checked here (loss and correction sections through
`jaxcorr.loss_config`, the algorithm through `jaxcorr.algorithm_config`), and
so are the combinations that only make sense together (batch geometry and
the mesh, a critic for GAE, a reference model for the KL terms, async mode
and its staleness bound). Errors are `ValueError`s naming
`config.<section>.<field>`, the value and the allowed values.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_collections

from jaxcorr import algorithm_config, config_sections, loss_config
from jaxcorr.losses import aggregate as agg_lib
from jaxcorr.losses import masked, objective
from jaxcorr.sharding import MeshConfig

DTYPES = ('float32', 'bfloat16', 'float16')


def _fail(path: str, value: Any, allowed: str) -> None:
  raise ValueError(f'{path}: invalid value {value!r}; allowed: {allowed}')


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _int(path: str, value: Any, lo: int) -> None:
  if not _is_int(value) or value < lo:
    _fail(path, value, f'an int >= {lo}')


def _num(path: str, value: Any, lo: float, *, strict: bool = False) -> None:
  ok = masked.is_number(value) and math.isfinite(value)
  ok = ok and (value > lo if strict else value >= lo)
  if not ok:
    _fail(path, value, f'a finite number {">" if strict else ">="} {lo}')


def _choice(path: str, value: Any, allowed: tuple) -> None:
  if value not in allowed:
    _fail(path, value, ', '.join(repr(a) for a in allowed))


def _bool(path: str, value: Any) -> None:
  if not isinstance(value, bool):
    _fail(path, value, 'True, False')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  hf_path: str = ''
  vocab_size: int = 32
  hidden_size: int = 128
  intermediate_size: int = 384
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  tie_embeddings: bool = True
  rope_theta: float = 10_000.0
  max_position_embeddings: int = 512
  initializer_range: float = 0.02
  dtype: str = 'float32'
  param_dtype: str = 'float32'
  remat: str = 'none'
  scan_layers: bool = False
  logprob_chunk: int = 128
  init_seed: int = 0

  def __post_init__(self):
    p = 'config.model'
    for name in (
      'vocab_size',
      'hidden_size',
      'intermediate_size',
      'num_layers',
      'num_heads',
      'num_kv_heads',
      'max_position_embeddings',
      'logprob_chunk',
    ):
      _int(f'{p}.{name}', getattr(self, name), 1)
    _int(f'{p}.init_seed', self.init_seed, 0)
    _choice(f'{p}.dtype', self.dtype, DTYPES)
    _choice(f'{p}.param_dtype', self.param_dtype, DTYPES)
    _choice(f'{p}.remat', self.remat, ('none', 'full', 'dots'))
    _bool(f'{p}.tie_embeddings', self.tie_embeddings)
    _bool(f'{p}.scan_layers', self.scan_layers)
    _num(f'{p}.initializer_range', self.initializer_range, 0, strict=True)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  source: str = 'arithmetic'
  path: str = ''
  eval_path: str = ''
  prompt_field: str = 'question'
  answer_field: str = 'answer'
  answer_format: str = 'gsm8k'
  prompt_template: str = '{prompt}'
  shuffle: bool = True
  num_examples: int = 100_000
  seed: int = 0
  max_operand: int = 99
  ops: str = '+'
  eval_examples: int = 256

  def __post_init__(self):
    p = 'config.data'
    _choice(f'{p}.source', self.source, ('arithmetic', 'jsonl', 'parquet'))
    if self.source != 'arithmetic' and not self.path:
      _fail(f'{p}.path', self.path, f'a local {self.source} file')
    _choice(f'{p}.answer_format', self.answer_format, ('gsm8k', 'raw'))
    from jaxcorr.train import data, tasks  # the template's own check

    data.format_prompt(self.prompt_template, tasks.Example('', ''))
    _bool(f'{p}.shuffle', self.shuffle)
    _int(f'{p}.num_examples', self.num_examples, 1)
    _int(f'{p}.seed', self.seed, 0)
    _int(f'{p}.max_operand', self.max_operand, 1)
    _int(f'{p}.eval_examples', self.eval_examples, 0)
    if not self.ops or set(self.ops) - set('+-*'):
      _fail(f'{p}.ops', self.ops, "a non-empty string of '+', '-', '*'")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  prompts_per_step: int = 16
  samples_per_prompt: int = 8
  max_prompt_length: int = 32
  max_new_tokens: int = 16
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  logprob_mode: str = 'full'
  max_concurrent_decodes: int = 64
  decode_chunk: int = 32
  engine_dtype: str = 'float32'
  engine_quant: str = 'none'
  mode: str = 'sync'
  rollout_devices: int = 0
  queue_size: int = 1
  max_staleness: int | None = None
  allow_nonfinite_logp: bool = False
  max_error_fraction: float = 0.0

  @property
  def batch_size(self) -> int:
    return self.prompts_per_step * self.samples_per_prompt

  def __post_init__(self):
    p = 'config.rollout'
    for name in (
      'prompts_per_step',
      'samples_per_prompt',
      'max_prompt_length',
      'max_new_tokens',
      'max_concurrent_decodes',
      'decode_chunk',
      'queue_size',
    ):
      _int(f'{p}.{name}', getattr(self, name), 1)
    _int(f'{p}.top_k', self.top_k, 0)
    _int(f'{p}.rollout_devices', self.rollout_devices, 0)
    _num(f'{p}.temperature', self.temperature, 0, strict=True)
    if not 0 < self.top_p <= 1:
      _fail(f'{p}.top_p', self.top_p, 'a number in (0, 1]')
    if not 0 <= self.min_p < 1:
      _fail(f'{p}.min_p', self.min_p, 'a number in [0, 1)')
    _choice(f'{p}.logprob_mode', self.logprob_mode, ('full', 'truncated'))
    _choice(f'{p}.engine_dtype', self.engine_dtype, DTYPES)
    _choice(f'{p}.engine_quant', self.engine_quant, ('none', 'int8'))
    _choice(f'{p}.mode', self.mode, ('sync', 'async'))
    if self.max_staleness is not None:
      _int(f'{p}.max_staleness', self.max_staleness, 0)
    if self.mode == 'async' and self.max_staleness is None:
      _fail(
        f'{p}.max_staleness',
        None,
        "an int >= 0 with rollout.mode='async' (the producer may not run "
        'further ahead than this many policy versions)',
      )
    _bool(f'{p}.allow_nonfinite_logp', self.allow_nonfinite_logp)
    if not 0 <= self.max_error_fraction <= 1:
      _fail(f'{p}.max_error_fraction', self.max_error_fraction, '[0, 1]')

  @property
  def truncation(self) -> bool:
    return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  functions: str = 'exact_match'
  timeout_s: float = 5.0

  def __post_init__(self):
    _num('config.reward.timeout_s', self.timeout_s, 0)
    from jaxcorr.train import reward_fns  # registry; imported lazily

    reward_fns.RewardScorer(reward_fns.parse_spec(self.functions), timeout_s=0)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  num_steps: int = 100
  sft_steps: int = 0
  sft_batch_size: int = 64
  ppo_epochs: int = 1
  mini_batches: int = 1
  micro_batches: int = 1
  shuffle_minibatches: bool = True
  checkpoint_every: int = 50
  keep_checkpoints: int = 3
  eval_every: int = 10
  eval_prompts: int = 128
  seed: int = 0
  tensorboard: bool = True
  log_every: int = 1

  def __post_init__(self):
    p = 'config.train'
    for name in ('num_steps', 'sft_steps', 'checkpoint_every', 'eval_every'):
      _int(f'{p}.{name}', getattr(self, name), 0)
    for name in (
      'sft_batch_size',
      'ppo_epochs',
      'mini_batches',
      'micro_batches',
      'keep_checkpoints',
      'log_every',
    ):
      _int(f'{p}.{name}', getattr(self, name), 1)
    _int(f'{p}.eval_prompts', self.eval_prompts, 0)
    _int(f'{p}.seed', self.seed, 0)
    _bool(f'{p}.shuffle_minibatches', self.shuffle_minibatches)
    _bool(f'{p}.tensorboard', self.tensorboard)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  learning_rate: float = 1e-6
  sft_learning_rate: float = 1e-3
  warmup_steps: int = 0
  schedule: str = 'constant'
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  max_grad_norm: float = 1.0

  def __post_init__(self):
    p = 'config.optim'
    _num(f'{p}.learning_rate', self.learning_rate, 0)
    _num(f'{p}.sft_learning_rate', self.sft_learning_rate, 0)
    _int(f'{p}.warmup_steps', self.warmup_steps, 0)
    _choice(f'{p}.schedule', self.schedule, ('constant', 'cosine'))
    if not 0 <= self.min_lr_ratio <= 1:
      _fail(f'{p}.min_lr_ratio', self.min_lr_ratio, 'a number in [0, 1]')
    _num(f'{p}.weight_decay', self.weight_decay, 0)
    for name in ('b1', 'b2'):
      if not 0 <= getattr(self, name) < 1:
        _fail(f'{p}.{name}', getattr(self, name), 'a number in [0, 1)')
    _num(f'{p}.eps', self.eps, 0, strict=True)
    _num(f'{p}.max_grad_norm', self.max_grad_norm, 0)


@dataclasses.dataclass(frozen=True)
class CriticConfig:
  enabled: bool = False
  learning_rate: float = 1e-5
  cliprange_value: float = 0.5
  agg: str = 'token_mean'

  def __post_init__(self):
    p = 'config.critic'
    _bool(f'{p}.enabled', self.enabled)
    _num(f'{p}.learning_rate', self.learning_rate, 0)
    _num(f'{p}.cliprange_value', self.cliprange_value, 0, strict=True)
    try:
      object.__setattr__(self, 'agg', agg_lib.canonical_mode(self.agg))
    except ValueError as e:
      raise ValueError(f'{p}.agg: {e}') from e


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything static about a run (hashable: a jit static argument)."""

  losses: loss_config.LossConfigs
  algorithm: algorithm_config.AlgorithmConfig
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


_SECTIONS = {
  'model': ModelConfig,
  'data': DataConfig,
  'rollout': RolloutConfig,
  'reward': RewardConfig,
  'train': TrainConfig,
  'optim': OptimConfig,
  'critic': CriticConfig,
}


def _section(config: ml_collections.ConfigDict, name: str, cls: type) -> Any:
  values = config_sections.values(config[name])
  path = f'config.{name}'
  config_sections.check_keys(path, values, config_sections.fields(cls))
  return config_sections.construct(cls, path, values)


def build(config: ml_collections.ConfigDict) -> RunConfig:
  """Validates the whole config; see the module docstring."""
  sections = {n: _section(config, n, c) for n, c in _SECTIONS.items()}
  mesh_values = config_sections.values(config.mesh)
  config_sections.check_keys(
    'config.mesh', mesh_values, ('data', 'fsdp', 'tensor')
  )
  for axis, size in mesh_values.items():
    if not _is_int(size) or not (size == -1 or size >= 1):
      _fail(f'config.mesh.{axis}', size, 'a positive int or -1')
  if list(mesh_values.values()).count(-1) > 1:
    _fail('config.mesh', mesh_values, 'at most one axis of size -1')
  run = RunConfig(
    losses=loss_config.build(config),
    algorithm=algorithm_config.build(config),
    mesh=MeshConfig(**mesh_values),
    **sections,
  )
  check_combinations(run)
  return run


def check_combinations(run: RunConfig) -> None:
  """Cross-section rules (no device needed)."""
  r, t = run.rollout, run.train
  algorithm_config.check_startup(
    run.algorithm,
    batch_size=r.batch_size,
    samples_per_prompt=r.samples_per_prompt,
  )
  chunks = t.mini_batches * t.micro_batches
  if r.batch_size % t.mini_batches:
    _fail(
      'config.train.mini_batches',
      t.mini_batches,
      f'a divisor of the batch (rollout.prompts_per_step * '
      f'samples_per_prompt = {r.batch_size})',
    )
  if chunks > r.batch_size:
    _fail(
      'config.train.micro_batches',
      t.micro_batches,
      f'at most batch/mini_batches = {r.batch_size // t.mini_batches}',
    )
  if run.algorithm.advantage.estimator == 'gae' and not run.critic.enabled:
    _fail(
      'config.critic.enabled',
      False,
      "True with algorithm.estimator='gae' (GAE needs values)",
    )
  if run.algorithm.advantage.estimator == 'remax':
    _fail(
      'config.algorithm.estimator',
      'remax',
      'an estimator other than remax: the trainer does not run the greedy '
      'baseline rollout remax needs',
    )
  corr = run.losses.correction
  if (
    corr is not None
    and corr.mode == 'bypass'
    and t.micro_batches > 1
    and objective.normalizer_kind(run.losses.actor) == 'mixed'
  ):
    _fail(
      'config.actor.agg',
      None,
      'an explicit mode with bypass correction and train.micro_batches > 1 '
      '(the policy loss and the entropy/KL terms would need different '
      'global divisors)',
    )
  scratch = not run.model.hf_path
  span = r.max_prompt_length + r.max_new_tokens
  if scratch and span > run.model.max_position_embeddings:
    _fail(
      'config.rollout.max_new_tokens',
      r.max_new_tokens,
      f'max_prompt_length + max_new_tokens <= model.max_position_embeddings '
      f'({run.model.max_position_embeddings})',
    )
