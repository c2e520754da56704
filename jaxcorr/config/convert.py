"""ml-collections sections <-> the frozen config dataclasses (start-up).

Each field is declared once, as a `setting` of its dataclass
(`jaxcorr.config.fields`). From those declarations:

* `section(cls)` derives the ConfigDict section `configs/` assigns (the
  defaults, typed placeholders for None, an `enabled` switch for sections
  that can be off);
* `build(config)` turns the whole ConfigDict into the hashable `RunConfig`
  once, before any device work: every field is checked by its own rule,
  and `check_combinations` adds the rules that span sections (batch
  geometry and the mesh, a critic for GAE, a reference model for the KL
  terms, async mode and its staleness bound). `losses`, `algorithm`,
  `correction` and `actor` build one part.

Every error is a `ValueError` raised with the full config path
(`config.rollout.mode: invalid value 'asynch'; allowed: 'sync', 'async'`):
each section is constructed inside `fields.at('config.<section>')`.

Command line: absl parses a float override as a float, so None cannot be
typed for a float field. Optional strings (`correction.is_level`,
`actor.agg`) accept the string `none`, and the dual clip is switched off
with `--config.actor.clip_ratio_c=inf` (the same loss as None).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import ml_collections
from ml_collections import config_dict

from jaxcorr.config import fields
from jaxcorr.losses import objective_config
from jaxcorr.losses.advantages import AdvantageConfig
from jaxcorr.losses.correction import CorrectionConfig
from jaxcorr.losses.objective_config import ActorLossConfig, LossConfigs
from jaxcorr.losses.rewards import KLControlConfig, check_kl_horizon
from jaxcorr.sharding import MeshConfig
from jaxcorr.train.run_config import SECTIONS, AlgorithmConfig, RunConfig

SWITCH = 'enabled'
"""The ConfigDict-only field of a section that can be off (the dataclass is
then None): `correction.enabled` (False: no correction, no rollout log-prob
needed) and `algorithm.kl_in_reward.enabled` (False: no KL in reward)."""

# ------------------------------------------------------------- derivation


def _scalar_type(hint: Any) -> type:
  """`float | None` -> float (the type of a placeholder)."""
  if (
    isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
  ):
    (hint,) = (a for a in typing.get_args(hint) if a is not type(None))
  return hint


def _settings(cls: type) -> list[dataclasses.Field]:
  return [f for f in dataclasses.fields(cls) if 'doc' in f.metadata]


def section(
  cls: type, *, switch: bool | None = None
) -> ml_collections.ConfigDict:
  """The ConfigDict of `cls`'s settings at their defaults.

  A None default becomes a typed placeholder, so a CLI override is parsed
  with the right type; `switch` adds `enabled` with that default.
  """
  hints = typing.get_type_hints(cls)
  out = ml_collections.ConfigDict()
  if switch is not None:
    out[SWITCH] = switch
  for f in _settings(cls):
    default = f.metadata.get('cli', f.default)
    if default is None:
      default = config_dict.placeholder(_scalar_type(hints[f.name]))
    out[f.name] = default
  return out


def algorithm_section() -> ml_collections.ConfigDict:
  """`config.algorithm`: the `AdvantageConfig` fields, `kl_penalty`, and the
  `kl_in_reward` section (`KLControlConfig` plus its switch, off)."""
  out = section(AdvantageConfig)
  out.update(section(AlgorithmConfig))
  out.kl_in_reward = section(KLControlConfig, switch=False)
  return out


# -------------------------------------------------------------- conversion


def _values(section_: Any) -> dict[str, Any]:
  if isinstance(section_, ml_collections.ConfigDict):
    return section_.to_dict()
  return dict(section_)


def _part(config: Any, name: str) -> dict[str, Any]:
  """The fields of `config.<name>`, or of `config` when it is the section."""
  is_cd = isinstance(config, ml_collections.ConfigDict)
  if is_cd and isinstance(config.get(name), ml_collections.ConfigDict):
    config = config[name]
  return _values(config)


def _check_keys(path: str, got: dict, allowed: tuple[str, ...]) -> None:
  """A key outside `allowed` is a typo that got past the locked config."""
  unknown = sorted(set(got) - set(allowed))
  if unknown:
    raise ValueError(
      f'{path} has unknown field(s) {", ".join(unknown)}; allowed: '
      + ', '.join(allowed)
    )


def _build(
  cls: type, path: str, values: dict[str, Any], *, switch: bool | None = None
) -> Any:
  """`cls(**values)` with errors named under `path`; None when the section
  has a switch and it is off."""
  names = tuple(f.name for f in _settings(cls))
  _check_keys(path, values, (SWITCH, *names) if switch is not None else names)
  if switch is not None:
    on = values.pop(SWITCH, switch)
    if not isinstance(on, bool):
      fields.fail(f'{path}.{SWITCH}', on, 'True or False', 'not True, False')
    if not on:
      return None
  hints = typing.get_type_hints(cls)
  for name, value in values.items():  # the CLI spelling of None
    optional_str = _scalar_type(hints[name]) is str and hints[name] is not str
    if optional_str and isinstance(value, str) and value.lower() == 'none':
      values[name] = None
  with fields.at(path):
    return cls(**values)


def correction(config: Any) -> CorrectionConfig | None:
  """`config.correction` (or the section itself); None when not enabled."""
  return _build(
    CorrectionConfig,
    'config.correction',
    _part(config, 'correction'),
    switch=True,
  )


def actor(config: Any) -> ActorLossConfig:
  """`config.actor` (or the section itself)."""
  return _build(ActorLossConfig, 'config.actor', _part(config, 'actor'))


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
  values = _part(config, 'algorithm')
  adv_names = tuple(f.name for f in _settings(AdvantageConfig))
  _check_keys(path, values, (*adv_names, 'kl_penalty', 'kl_in_reward'))
  advantage = _build(
    AdvantageConfig, path, {k: values[k] for k in adv_names if k in values}
  )
  kl_ctrl = _build(
    KLControlConfig,
    f'{path}.kl_in_reward',
    _values(values.get('kl_in_reward', {})),
    switch=False,
  )
  rest = {k: values[k] for k in ('kl_penalty',) if k in values}
  with fields.at(path):
    return AlgorithmConfig(advantage=advantage, kl_in_reward=kl_ctrl, **rest)


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


def build(config: ml_collections.ConfigDict) -> RunConfig:
  """Validates the whole config; see the module docstring."""
  parts = {
    name: _build(cls, f'config.{name}', _values(config[name]))
    for name, cls in SECTIONS.items()
  }
  run = RunConfig(
    losses=losses(config),
    algorithm=algorithm(config),
    mesh=_build(MeshConfig, 'config.mesh', _values(config.mesh)),
    **parts,
  )
  check_combinations(run)
  return run


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
  estimator = run.algorithm.advantage.estimator
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
  span = r.max_prompt_length + r.max_new_tokens
  if not run.model.hf_path and span > run.model.max_position_embeddings:
    fail(
      'config.rollout.max_new_tokens',
      r.max_new_tokens,
      f'max_prompt_length + max_new_tokens <= model.max_position_embeddings '
      f'({run.model.max_position_embeddings})',
    )
