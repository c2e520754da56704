"""Rollout-correction presets (docs/math/correction.md §6), defined once, here.

A preset is a set of overrides of existing config fields, written as dotted
paths (`'correction.is_level'`). It never adds a key: `apply_preset` raises
when a path does not exist in the config it is applied to. Every config file
accepts a preset name as its config string and applies it on top of its own
fields::

  --config=configs/base.py:decoupled_token_is
  --config=configs/base.py:bypass_ppo_clip+rollout_kl

Names:

* the 31 presets of `PRESETS` (the first 19 carry verl's names and values;
  three use the stale-data losses `m2po`, `topr` and `cispo_rollout`
  (jaxcorr/losses/policy/ratio.py, jaxcorr/losses/policy/logprob.py), and
  `nemo_seq_logprob_error` NeMo-RL's sequence log-prob-error mask);
* `<preset>+rollout_kl`: the preset plus the rollout-KL term
  (`actor.rollout_kl_type='k2'`, `actor.rollout_kl_coef=2e-3`);
* `rollout_kl`: `disabled+rollout_kl`;
* an empty or missing name: `disabled`.

verl's docstring mentions `decoupled_k1_rs`, `bypass_ppo_clip_k1_rs` and
`bypass_pg_k1_rs`, which verl does not define; asking for one fails with a hint
to use the `geo_rs` equivalent (geo-RS *is* the k1 sequence-mean criterion).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import ml_collections

# Shorthands for the repeated table cells; every value is written out in full.
_DEC = {'correction.mode': 'decoupled'}
_PPO = {'correction.mode': 'bypass', 'correction.bypass_loss': 'ppo_clip'}
_PG = {
  'correction.mode': 'bypass',
  'correction.bypass_loss': 'reinforce',
  'actor.policy_loss': 'reinforce',
}


def _tis(level: str, upper: float) -> dict[str, Any]:
  return {
    'correction.is_level': level,
    'correction.is_mode': 'truncate',
    'correction.is_upper': upper,
  }


def _icepop(lower: float, upper: float) -> dict[str, Any]:
  return {
    'correction.is_level': 'token',
    'correction.is_mode': 'mask',
    'correction.is_lower': lower,
    'correction.is_upper': upper,
  }


def _rs(criteria: str, bounds: str) -> dict[str, Any]:
  return {'correction.rs': criteria, 'correction.rs_bounds': bounds}


_GEO = _rs('seq_mean_k1', '0.999_1.001')
_K3 = _rs('seq_mean_k3', '0.01')

PRESETS: dict[str, dict[str, Any]] = {
  # ----------------------------------------------------- verl (names, values)
  'disabled': {**_DEC},
  'decoupled_token_is': {**_DEC, **_tis('token', 2.0)},
  'decoupled_seq_is': {**_DEC, **_tis('sequence', 2.0)},
  'decoupled_token_icepop': {**_DEC, **_icepop(0.5, 5.0)},
  'decoupled_seq_is_rs': {
    **_DEC,
    **_tis('sequence', 2.0),
    **_rs('seq_sum_k1', '0.5_2.0'),
  },
  'decoupled_geo_rs': {**_DEC, **_GEO},
  'decoupled_geo_rs_seq_tis': {**_DEC, **_tis('sequence', 2.0), **_GEO},
  'decoupled_geo_rs_token_tis': {**_DEC, **_tis('token', 2.0), **_GEO},
  'decoupled_k3_rs': {**_DEC, **_K3},
  'decoupled_k3_rs_seq_tis': {**_DEC, **_tis('sequence', 2.0), **_K3},
  'decoupled_k3_rs_token_tis': {**_DEC, **_tis('token', 2.0), **_K3},
  'bypass_ppo_clip': {**_PPO},
  'bypass_ppo_clip_geo_rs': {**_PPO, **_GEO},
  'bypass_ppo_clip_k3_rs': {**_PPO, **_K3},
  'bypass_pg_is': {**_PG, **_tis('sequence', 2.0)},
  'bypass_pg_token_icepop': {**_PG, **_icepop(0.5, 5.0)},
  'bypass_pg_geo_rs': {**_PG, **_GEO},
  'bypass_pg_geo_rs_seq_tis': {**_PG, **_tis('sequence', 2.0), **_GEO},
  'bypass_pg_geo_rs_token_tis': {**_PG, **_tis('token', 2.0), **_GEO},
  # ----------------------------------------------------- SkyRL, slime, prime
  'skyrl_token_tis': {**_DEC, **_tis('token', 2.0)},
  'skyrl_seq_tis': {**_DEC, **_tis('sequence', 5.0)},
  'skyrl_geo_mask': {**_DEC, **_rs('seq_mean_k1', '0.99_1.01')},
  'skyrl_outlier_mask': {
    **_DEC,
    'correction.veto_low': 1e-4,
    'correction.veto_high': 100.0,
  },
  'slime_mis': {
    **_DEC,
    **_tis('token', 2.0),
    'correction.is_lower': 0.5,
    **_rs('token_k1', '0.5_2.0'),
    'correction.veto_low': 1e-4,
    'correction.is_batch_normalize': True,
  },
  'prime_dppo_kl': {
    **_PPO,
    'actor.policy_loss': 'prime',
    'actor.agg': 'token_mean',
  },
  # --------------------- stale-data losses (docs/correction.md §2, the
  # estimators for stale data)
  # Knobs at their references' defaults (jaxcorr.losses.policy.PolicyKnobs).
  'decoupled_m2po': {**_DEC, 'actor.policy_loss': 'm2po'},
  'decoupled_topr': {**_DEC, 'actor.policy_loss': 'topr'},
  'bypass_cispo_rollout': {**_PPO, 'actor.policy_loss': 'cispo_rollout'},
  # M2PO's ratio against μ itself: with one update per batch, decoupled
  # M2PO's π_θ/π_old is 1 and it trains exactly as 'disabled' does.
  'bypass_m2po': {**_PPO, 'actor.policy_loss': 'm2po'},
  # NeMo-RL's seq_logprob_error_threshold defaults to null (metrics only);
  # 2 is the value of its published recipe, examples/nemo_gym/grpo_nanov3.yaml.
  'nemo_seq_logprob_error': {**_DEC, **_rs('seq_mean_mpe', '2.0')},
  # VCPO (jaxcorr/losses/vcpo.py) on top of token TIS: the ESS-scaled step
  # and the off-policy optimal baseline, the authors' fork's defaults.
  'decoupled_vcpo': {
    **_DEC,
    **_tis('token', 2.0),
    'actor.ess_scaling': True,
    'actor.grad_baselining': True,
  },
}
"""Preset name -> {dotted config path: value}. Blank table cells are absent."""

DEFAULT = 'disabled'
ROLLOUT_KL_SUFFIX = '+rollout_kl'
ROLLOUT_KL = {'actor.rollout_kl_type': 'k2', 'actor.rollout_kl_coef': 2e-3}
"""What `+rollout_kl` adds: ½(log π_θ − log μ)² with prime-rl's 2·kl_tau."""

GHOSTS = {
  'decoupled_k1_rs': 'decoupled_geo_rs',
  'bypass_ppo_clip_k1_rs': 'bypass_ppo_clip_geo_rs',
  'bypass_pg_k1_rs': 'bypass_pg_geo_rs',
}
"""Names verl's docstring mentions but never defined -> the geo-RS preset."""


def names() -> tuple[str, ...]:
  """Every accepted name, `+rollout_kl` forms included."""
  base = tuple(PRESETS)
  return (
    *base,
    'rollout_kl',
    *(n + ROLLOUT_KL_SUFFIX for n in base),
  )


def _unknown(name: str) -> ValueError:
  base = name.removesuffix(ROLLOUT_KL_SUFFIX)
  if base in GHOSTS:
    geo = GHOSTS[base]
    return ValueError(
      f'preset {name!r} does not exist (verl mentions it but never defined '
      f'it); use {geo!r}: the k1 sequence-mean criterion is geo-RS '
      f"(rs='seq_mean_k1')"
    )
  close = difflib.get_close_matches(name, names(), n=1)
  hint = f' Did you mean {close[0]!r}?' if close else ''
  return ValueError(
    f'unknown preset {name!r}.{hint} Valid presets: '
    + ', '.join(PRESETS)
    + f"; append {ROLLOUT_KL_SUFFIX!r} to any of them; 'rollout_kl' alone "
    "means 'disabled+rollout_kl'"
  )


def overrides(name: str | None) -> dict[str, Any]:
  """The `{dotted path: value}` overrides of preset `name` (None: disabled)."""
  name = (name or '').strip() or DEFAULT
  if name == 'rollout_kl':
    name = DEFAULT + ROLLOUT_KL_SUFFIX
  base, suffix = name, {}
  if name.endswith(ROLLOUT_KL_SUFFIX):
    base, suffix = name.removesuffix(ROLLOUT_KL_SUFFIX), ROLLOUT_KL
  if base not in PRESETS:
    raise _unknown(name)
  return {**PRESETS[base], **suffix}


def apply_overrides(
  config: ml_collections.ConfigDict, values: Mapping[str, Any]
) -> None:
  """Sets existing dotted paths of `config`; a missing path is an error."""
  for path, value in values.items():
    *parents, leaf = path.split('.')
    node = config
    for part in parents:
      if part not in node:
        raise KeyError(f'preset path {path!r}: no section {part!r} in config')
      node = node[part]
    if leaf not in node:
      raise KeyError(f'preset path {path!r}: no field {leaf!r} in config')
    node[leaf] = value


def apply_preset(
  config: ml_collections.ConfigDict, name: str | None
) -> ml_collections.ConfigDict:
  """Applies preset `name` to `config` in place and returns it."""
  apply_overrides(config, overrides(name))
  return config
