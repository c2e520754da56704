"""The composition root: a run's ConfigDict -> its validated `RunConfig`.

The only module that knows every section. `build(config)` runs once, at
start-up, before any device work (`jaxcorr.main` calls it and hands the
result to the `Trainer`):

1. every section is built from its ConfigDict section by the generic
   converter (`jaxcorr.config.convert.build`), each field checked by its own
   rule; `losses`, `algorithm`, `correction` and `actor` build the sections
   that are assembled from several dataclasses;
2. `check_combinations` adds the rules that span sections (batch geometry
   and the mesh, a critic for GAE, the policy loss against the correction,
   the sequence length against the model);
3. `check_components` runs the start-up checks that need a component's own
   code rather than a field rule: the prompt template formats, every reward
   function is registered and its verifier installed, reasoning-gym task
   names exist.

Every error is a `ValueError` naming the full config path, the value and the
allowed values. `configs/` derives the ConfigDict sections from the same
classes (configs/trainer.py from `SECTIONS`).
"""

from __future__ import annotations

from typing import Any

import jax
import ml_collections

from jaxcorr import rewards
from jaxcorr.agents.config import AgentConfig, check_call_format
from jaxcorr.agents.environment import environment_spec
from jaxcorr.config import convert, fields
from jaxcorr.data import prompts, reasoning_gym, text
from jaxcorr.data.config import DataConfig
from jaxcorr.data.tasks import Example
from jaxcorr.losses import objective_config, overlong, vcpo
from jaxcorr.losses.advantages import AdvantageConfig
from jaxcorr.losses.correction import CorrectionConfig
from jaxcorr.losses.objective_config import ActorLossConfig, LossConfigs
from jaxcorr.losses.rewards import KLControlConfig, check_kl_horizon
from jaxcorr.model import TransformerConfig
from jaxcorr.model.lora import LoraConfig
from jaxcorr.rollout import precision
from jaxcorr.rollout.speculative_config import SpeculativeConfig
from jaxcorr.sharding import MeshConfig
from jaxcorr.train.critic import CriticConfig
from jaxcorr.train.distill import DistillConfig
from jaxcorr.train.distill import rules as distill_rules
from jaxcorr.train.distill import teacher as distill_teacher
from jaxcorr.train.evals import sets as eval_sets
from jaxcorr.train.evals.config import EvalConfig
from jaxcorr.train.policy import (
  ModelConfig,
  check_attention,
  transformer_config,
)
from jaxcorr.train.rollouts import draft as spec_draft
from jaxcorr.train.rollouts import dynamic_sampling
from jaxcorr.train.rollouts.config import RolloutConfig
from jaxcorr.train.rollouts.weights import quant_spec
from jaxcorr.train.routing.config import MoEConfig
from jaxcorr.train.routing.config import check_model as check_moe_model
from jaxcorr.train.run_config import AlgorithmConfig, RunConfig, TrainConfig
from jaxcorr.train.state import OptimConfig
from jaxcorr.train.tracker import sinks

SECTIONS: dict[str, type] = {
  'model': ModelConfig,
  'data': DataConfig,
  'rollout': RolloutConfig,
  'reward': rewards.RewardConfig,
  'train': TrainConfig,
  'optim': OptimConfig,
  'critic': CriticConfig,
  'mesh': MeshConfig,
  'eval': EvalConfig,
  'agent': AgentConfig,
  'lora': LoraConfig,
  'moe': MoEConfig,
  'dynamic_sampling': dynamic_sampling.DynamicSamplingConfig,
  'distill': DistillConfig,
  'speculative': SpeculativeConfig,
}
"""The trainer sections that map one ConfigDict section to one dataclass
(`correction`, `actor` and `algorithm` are assembled below)."""

# ---------------------------------------------------------------- sections


def correction(config: Any) -> CorrectionConfig | None:
  """`config.correction` (or the section itself); None when not enabled."""
  return convert.build(
    CorrectionConfig,
    'config.correction',
    convert.part(config, 'correction'),
    switch=True,
  )


def actor(config: Any) -> ActorLossConfig:
  """`config.actor` (or the section itself)."""
  return convert.build(
    ActorLossConfig, 'config.actor', convert.part(config, 'actor')
  )


def losses(config: Any, *, rollout_logp_available: bool = True) -> LossConfigs:
  """The actor and correction configs, checked together.

  Args:
    config: the run's ConfigDict (with `correction` and `actor` sections).
    rollout_logp_available: whether the rollout engine reports per-token
      log-probs. Without them only `correction.enabled=False`, losses that
      do not read `rollout_logp` and `actor.rollout_kl_coef=0` are allowed.
  """
  pair = LossConfigs(actor=actor(config), correction=correction(config))
  objective_config.check_compatible(
    *pair, rollout_logp_available=rollout_logp_available
  )
  return pair


def algorithm(config: Any) -> AlgorithmConfig:
  """`config.algorithm` (or the section itself, a ConfigDict or a dict)."""
  path = 'config.algorithm'
  values = convert.part(config, 'algorithm')
  adv_names = convert.names(AdvantageConfig)
  convert.check_keys(path, values, (*adv_names, 'kl_penalty', 'kl_in_reward'))
  advantage = convert.build(
    AdvantageConfig, path, {k: values[k] for k in adv_names if k in values}
  )
  kl_ctrl = convert.build(
    KLControlConfig,
    f'{path}.kl_in_reward',
    convert.values(values.get('kl_in_reward', {})),
    switch=False,
  )
  rest = {k: values[k] for k in ('kl_penalty',) if k in values}
  with fields.at(path):
    return AlgorithmConfig(advantage=advantage, kl_in_reward=kl_ctrl, **rest)


# -------------------------------------------------------------- the run


def build(config: ml_collections.ConfigDict) -> RunConfig:
  """The run's `RunConfig`, every field and combination checked (module
  doc); the one way from a ConfigDict to a `RunConfig`."""
  parts = {
    name: convert.build(cls, f'config.{name}', convert.values(config[name]))
    for name, cls in SECTIONS.items()
  }
  run = RunConfig(losses=losses(config), algorithm=algorithm(config), **parts)
  check_combinations(run)
  check_components(run)
  return run


def check_startup(
  cfg: AlgorithmConfig, *, batch_size: int, samples_per_prompt: int
) -> None:
  """Algorithm checks that need the batch geometry.

  Raises:
    ValueError: `grpo_passk` with fewer than 2 samples per prompt, or an
      adaptive horizon with `0.2·batch_size/horizon >= 1`.
  """
  if cfg.advantage.estimator == 'grpo_passk' and samples_per_prompt < 2:
    raise ValueError(
      "config.algorithm.estimator: 'grpo_passk' needs samples_per_prompt "
      f'>= 2, got {samples_per_prompt}; allowed: another estimator, or >= 2 '
      'samples'
    )
  if cfg.kl_in_reward is not None:
    check_kl_horizon(
      cfg.kl_in_reward, batch_size, path='config.algorithm.kl_in_reward'
    )


def _check_moe(run: RunConfig) -> None:
  """R2 needs a π_old pass; the balance terms need global normalisers;
  replay needs an MoE policy."""
  moe = run.moe
  if moe.router_replay != 'none' and (model := _policy_config(run)):
    check_moe_model(moe, model)
  if moe.router_replay == 'old' and not run.decoupled:
    fields.fail(
      'config.moe.router_replay',
      'old',
      "'none' or 'rollout' with bypass correction (R2 replays the routing "
      "of the trainer's pi_old pass, which bypass mode does not run)",
    )
  if (moe.aux_loss_coef or moe.z_loss_coef) and not run.decoupled:
    fields.fail(
      'config.moe.aux_loss_coef',
      moe.aux_loss_coef,
      '0 (and z_loss_coef 0) with bypass correction: its loss is divided '
      'by the corrected token count at the end, which would rescale the '
      'balance terms; use correction.mode=decoupled',
    )


def _policy_config(run: RunConfig) -> TransformerConfig | None:
  """The policy's `TransformerConfig`, for the rules on its shapes; None
  when `model.hf_path` has no config.json (loading the model says so).
  Shapes only: `model.dtype='auto'` is resolved as on CPU, since asking
  for the backend would start it before `jax.distributed`."""
  try:
    return transformer_config(run.model, backend='cpu')
  except OSError:
    return None


def check_combinations(run: RunConfig) -> None:
  """Cross-section rules (no device needed)."""
  r, t = run.rollout, run.train
  check_startup(
    run.algorithm,
    batch_size=r.batch_size,
    samples_per_prompt=r.samples_per_prompt,
  )
  fail = fields.fail
  if r.batch_size % t.mini_batches:
    fail(
      'config.train.mini_batches',
      t.mini_batches,
      f'a divisor of the batch (rollout.prompts_per_step * '
      f'samples_per_prompt = {r.batch_size})',
    )
  if t.mini_batches * t.micro_batches > r.batch_size:
    fail(
      'config.train.micro_batches',
      t.micro_batches,
      f'at most batch/mini_batches = {r.batch_size // t.mini_batches}',
    )
  _check_moe(run)
  dynamic_sampling.check(
    run.dynamic_sampling,
    r.samples_per_prompt,
    [name for name, _ in rewards.parse_spec(run.reward.functions)],
  )
  estimator = run.algorithm.advantage.estimator
  overlong.check_max_length(run.reward, r.max_new_tokens, 'config.reward')
  vcpo.check_estimator(run.losses.actor, estimator, run.algorithm.kl_in_reward)
  if estimator == 'gae' and not run.critic.enabled:
    fail(
      'config.critic.enabled',
      False,
      "True with algorithm.estimator='gae' (GAE needs values)",
    )
  if estimator == 'remax':
    fail(
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
    and objective_config.normalizer_kind(run.losses.actor) == 'mixed'
  ):
    fail(
      'config.actor.agg',
      None,
      'an explicit mode with bypass correction and train.micro_batches > 1 '
      '(the policy loss and the entropy/KL terms would need different '
      'global divisors)',
    )
  check_packing(run)
  check_context_parallel(run)
  distill_rules.check(run)
  check_agent(run)
  check_lora(run)
  check_precision(run)
  text.check_tokenizer(
    run.data.tokenizer, run.model.hf_path, run.model.vocab_size
  )
  span = r.max_prompt_length + r.max_new_tokens
  if not run.model.hf_path and span > run.model.max_position_embeddings:
    fail(
      'config.rollout.max_new_tokens',
      r.max_new_tokens,
      f'max_prompt_length + max_new_tokens <= model.max_position_embeddings '
      f'({run.model.max_position_embeddings})',
    )


def check_agent(run: RunConfig) -> None:
  """Multi-turn rollouts (`config.agent`) with the rollout settings they
  support: every rollout mode, log-probs 'full' or 'truncated'."""
  if not run.agent.enabled:
    return
  r = run.rollout
  if r.logprob_mode == 'replay':
    fields.fail(
      'config.rollout.logprob_mode',
      r.logprob_mode,
      "'full' or 'truncated' with config.agent.environment (multi-turn "
      'rollouts record no kept sets)',
    )
  if r.kv_cache_dtype in ('int8', 'fp8'):
    fields.fail(
      'config.rollout.kv_cache_dtype',
      r.kv_cache_dtype,
      "'model' or a float dtype with config.agent.environment (a turn's "
      'continuation writes a full-precision cache)',
    )
  if run.model.num_experts:
    fields.fail(
      'config.agent.environment',
      run.agent.environment,
      "'' with an MoE model (model.num_experts > 0): a turn's continuation "
      'records no routing',
    )
  if run.agent.chat_template == 'model' and not run.model.hf_path:
    fields.fail(
      'config.agent.chat_template',
      'model',
      "'arith' without config.model.hf_path",
      'a model from scratch has no chat template of its own',
    )


def check_packing(run: RunConfig) -> None:
  """`train.packing` with what the packed forward supports (full log-probs
  of a dense policy; docs/training.md)."""
  if not run.train.packing:
    return
  r = run.rollout
  if r.logprob_mode != 'full':
    fields.fail(
      'config.rollout.logprob_mode',
      r.logprob_mode,
      "'full' with train.packing=True (the truncated and replay log-probs "
      'read unpacked rows)',
    )
  if run.model.num_experts:
    fields.fail(
      'config.train.packing',
      True,
      'False with an MoE model (model.num_experts > 0)',
      'the packed forward does not replay routing yet',
    )


def check_context_parallel(run: RunConfig) -> None:
  """`mesh.sequence` > 1 (rows split over devices,
  jaxcorr/model/context_parallel.py) with rows it splits evenly and what
  the engine side can serve."""
  n, r = run.mesh.sequence, run.rollout
  if n == 1:
    return
  length = r.max_prompt_length + r.max_new_tokens
  if length % n:
    fields.fail(
      'config.mesh.sequence',
      n,
      f'a divisor of the row length rollout.max_prompt_length + '
      f'max_new_tokens = {length} (packed rows too have this length)',
    )
  if r.exact:
    fields.fail(
      'config.rollout.exact',
      True,
      'False with config.mesh.sequence > 1',
      "exact mode replays the engine's unsplit cached forward bit for bit "
      'on the trainer mesh; the engine never splits rows',
    )


def check_lora(run: RunConfig) -> None:
  """A LoRA policy (`config.lora`) with what its adapter-only training and
  sync support (docs/lora.md)."""
  if not run.lora.enabled:
    return
  r = run.rollout
  if run.train.sft_steps:
    fields.fail(
      'config.train.sft_steps',
      run.train.sft_steps,
      '0 with config.lora.rank > 0',
      'the SFT warm-up trains every weight; a LoRA run starts from its model',
    )
  if r.simulated_quant != 'none':
    fields.fail(
      'config.rollout.simulated_quant',
      r.simulated_quant,
      "'none' with config.lora.rank > 0",
      'a LoRA sync sends adapters, which the int8 fake-quantiser does not take',
    )
  if r.quantization != 'none':
    fields.fail(
      'config.rollout.quantization',
      r.quantization,
      "'none' with config.lora.rank > 0",
      'the LoRA engine merges adapters into full-precision weights',
    )


def check_precision(run: RunConfig) -> None:
  """The engine's quantization against the correction mode and the
  backend (docs/precision.md)."""
  r = run.rollout
  if r.matched_precision and not run.decoupled:
    fields.fail(
      'config.rollout.matched_precision',
      True,
      'False with correction.mode=bypass (π_old is then μ itself: there '
      'is no trainer forward to match)',
    )
  block = r.quantization_block
  if block and (model := _policy_config(run)):
    refusal = precision.block_refusal(model, block)
    if refusal:
      fields.fail('config.rollout.quantization_block', block, *refusal)
  spec, why = quant_spec(r), None
  if spec is not None and spec.activations:
    # Only W8A8 depends on the backend. Asking for it starts it, which must
    # wait for jax.distributed (jaxcorr.main builds the config first).
    why = precision.unsupported(spec, jax.default_backend())
  if why:
    fields.fail(
      'config.rollout.quantize_activations', r.quantize_activations, why
    )


def check_backend(run: RunConfig) -> None:
  """Start-up checks that ask the backend, run after `jax.distributed`
  (`jaxcorr.main`): `model.attention` runs on it in the trainer's and the
  engine's dtypes (`jaxcorr.train.policy.check_attention`)."""
  backend = jax.default_backend()
  check_attention(run.model, run.rollout.engine_dtype, backend)


def check_components(run: RunConfig) -> None:
  """Start-up checks that run a component's code (no device, no file):
  `config.data.prompt_template` formats (`jaxcorr.data.prompts.format_prompt`
  on an empty prompt), every function of `config.reward.functions` is
  registered now (`jaxcorr.rewards.check_spec`) and has its verifier package
  (`jaxcorr.rewards.check_installed`), a reasoning-gym source names known
  tasks and a working task config (`jaxcorr.data.reasoning_gym.check`), and
  the package of every logger of `config.train.loggers` is installed
  (`jaxcorr.train.tracker.sinks.check_installed`), and every eval set of
  `config.eval.sets` names data fields and has held-out prompts
  (`jaxcorr.train.evals.sets.check`)."""
  prompts.format_prompt(run.data.prompt_template, Example('', ''))
  names, _ = rewards.check_spec(rewards.parse_spec(run.reward.functions))
  rewards.check_installed(names)
  if run.data.source == 'reasoning_gym':
    reasoning_gym.check(run.data, names, run.train.sft_steps)
  sinks.check_installed(run.train.loggers)
  eval_sets.check(run)
  if run.distill.enabled:  # the teacher's path, tokenizer, vocabulary
    distill_teacher.check_for_run(run)
  spec_draft.check_for_run(run)  # with the other sections; the draft's files
  if run.agent.enabled:
    spec = environment_spec(run.agent.environment, run.agent)
    if run.train.sft_steps and spec.expert is None:
      fields.fail(
        'config.train.sft_steps',
        run.train.sft_steps,
        f'0 with config.agent.environment={run.agent.environment!r}',
        'the SFT warm-up of a multi-turn run plays the environment expert, '
        'and this environment has none (jaxcorr/agents/demonstrations.py)',
      )
    if not run.model.hf_path:  # a tokenizer from scratch: no file to read
      tokenizer = text.scratch_tokenizer(run.data.tokenizer)
      check_call_format(run.agent, spec, tokenizer)
