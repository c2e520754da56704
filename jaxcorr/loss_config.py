"""ml-collections config -> the frozen loss dataclasses, at the jit boundary.

The trainer reads `configs/base.py` (or a task config) through absl flags and
calls `build(config)` once at start-up. Everything that does not depend on
array values is checked there, so a bad flag fails before any compilation
(D7), with a `ValueError` that names the config field, the value and the
allowed values:

* every `CorrectionConfig` rule (docs/math/correction.md §3): an RS criterion
  without bounds, a k2/k3 bound written as `'lo_up'`, a legacy RS name, ...;
* every `ActorLossConfig` rule: an unknown loss, aggregation mode, KL
  estimator or knob value;
* the combination checks of `objective.check_compatible`: a policy loss not
  allowed in the correction's mode, IS weights with `rollout_is`/`prime`, a
  correction or rollout-KL term without rollout log-probs.

Bypass + `reinforce` with no IS level, no rejection and no veto is accepted:
it is plain REINFORCE against μ with the correction's diagnostics only, the
bypass counterpart of the `disabled` preset, and verl runs it too
(`objective.check_compatible` documents why it is sound).

Command line: absl parses a float override as a float, so None cannot be
typed for a float field. `is_level` and `agg` accept the string `none`
(`--config.correction.is_level=none`), and the dual clip is switched off with
`--config.actor.clip_ratio_c=inf` (c → ∞ never binds, the same loss as None).

The returned dataclasses are hashable and are meant to be static arguments
of the jitted step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import ml_collections

from jaxcorr import config_sections
from jaxcorr.losses import correction as corr_lib
from jaxcorr.losses import objective

_SWITCH = 'enabled'


class LossConfigs(NamedTuple):
  """The validated, static loss configuration of a run."""

  actor: objective.ActorLossConfig
  correction: corr_lib.CorrectionConfig | None


def _section(config: Any, name: str) -> dict[str, Any]:
  """The fields of `config.<name>`, or of `config` when it is the section."""
  section = config
  is_cd = isinstance(config, ml_collections.ConfigDict)
  if is_cd and isinstance(config.get(name), ml_collections.ConfigDict):
    section = config[name]
  return config_sections.values(section)


def _none_strings(values: dict[str, Any], names: tuple[str, ...]) -> None:
  """'none'/'None' -> None for optional string fields (CLI spelling)."""
  for name in names:
    if isinstance(values.get(name), str) and values[name].lower() == 'none':
      values[name] = None


def correction_config(cd: Any) -> corr_lib.CorrectionConfig | None:
  """The `CorrectionConfig` of `cd.correction` (or of a correction section).

  Returns None when `enabled` is False: no correction runs and no rollout
  log-prob is needed. `rs`/`rs_bounds` are verl's comma strings; `''` or
  None means no rejection.
  """
  values = _section(cd, 'correction')
  fields = config_sections.fields(corr_lib.CorrectionConfig)
  config_sections.check_keys('config.correction', values, (_SWITCH, *fields))
  enabled = values.pop(_SWITCH, True)
  if not isinstance(enabled, bool):
    raise ValueError(
      f'config.correction.enabled={enabled!r} is invalid; allowed: True, False'
    )
  if not enabled:
    return None
  _none_strings(values, ('is_level',))
  for name in ('rs', 'rs_bounds'):
    if name in values and values[name] in ('', None):
      values[name] = ()
  return config_sections.construct(
    corr_lib.CorrectionConfig, 'config.correction', values
  )


def actor_loss_config(cd: Any) -> objective.ActorLossConfig:
  """The `ActorLossConfig` of `cd.actor` (or of an actor section)."""
  values = _section(cd, 'actor')
  config_sections.check_keys(
    'config.actor', values, config_sections.fields(objective.ActorLossConfig)
  )
  _none_strings(values, ('agg',))
  return config_sections.construct(
    objective.ActorLossConfig, 'config.actor', values
  )


def build(
  config: ml_collections.ConfigDict, *, rollout_logp_available: bool = True
) -> LossConfigs:
  """Validates the whole loss configuration and returns the dataclasses.

  Args:
    config: the run's ConfigDict (with `correction` and `actor` sections).
    rollout_logp_available: whether the rollout engine reports per-token
      log-probs. Without them only `correction.enabled=False`, losses that
      do not read `rollout_logp` and `actor.rollout_kl_coef=0` are allowed.

  Raises:
    ValueError: naming the field, the value and the allowed values.
  """
  actor = actor_loss_config(config)
  corr = correction_config(config)
  objective.check_compatible(
    actor, corr, rollout_logp_available=rollout_logp_available
  )
  return LossConfigs(actor=actor, correction=corr)
