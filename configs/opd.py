"""On-policy distillation presets (`config.distill`, docs/distillation.md),
shared by configs/arith_opd_tiny.py and configs/smollm2_opd.py.

Their config string is `[pulse+]<opd preset>[+<correction preset>]`, e.g.
`pulse+opd_k1`, `opd_engine+decoupled_token_is`. The correction preset
(configs/presets.py) corrects the *student's* μ vs π as in any RL run.
"""

from __future__ import annotations

from typing import Any

import ml_collections

OPD_PRESETS: dict[str, dict[str, Any]] = {
  # Thinking Machines / verl use_kl_as_reward: the reverse KL is the reward.
  'opd_k1': {'distill.estimator': 'k1'},
  'opd_k3': {'distill.estimator': 'k3'},
  # slime --use-opd: the task advantage minus coef x reverse KL.
  'opd_rl': {'distill.task_reward': True, 'distill.coef': 1.0},
  # The teacher's log-probs as an engine gives them: gap measured, trained
  # on the trainer-side pass (corrected) or on the engine's (slime sglang).
  'opd_engine': {'distill.logp_source': 'engine'},
  'opd_engine_raw': {
    'distill.logp_source': 'engine',
    'distill.correct_teacher': False,
  },
  # Direct losses in the update on the current student (the policy loss
  # trains on zero advantages unless distill.task_reward): verl
  # distillation.loss_mode k3, forward_kl_topk; TRL GKD's JSD at lambda 1.
  'opd_direct_k3': {'distill.loss': 'reverse_kl', 'distill.estimator': 'k3'},
  'opd_topk': {'distill.loss': 'topk_kl', 'distill.topk': 16},
  'opd_gjsd': {'distill.loss': 'gjsd', 'distill.topk': 16, 'distill.beta': 0.5},
}


def split(config_string: str | None) -> tuple[bool, str, str | None]:
  """'pulse+opd_k3+decoupled_token_is' -> (True, 'opd_k3',
  'decoupled_token_is'); the OPD preset defaults to opd_k1."""
  parts = [p for p in (config_string or '').split('+') if p]
  pulse = bool(parts) and parts[0] == 'pulse'
  parts = parts[1:] if pulse else parts
  opd = 'opd_k1'
  if parts and parts[0].startswith('opd_'):
    opd = parts.pop(0)
  if opd not in OPD_PRESETS:
    raise ValueError(
      f'OPD preset {opd!r}; allowed: ' + ', '.join(sorted(OPD_PRESETS))
    )
  return pulse, opd, '+'.join(parts) or None


def apply(config: ml_collections.ConfigDict, opd: str) -> None:
  """Set the OPD preset's fields (existing keys only)."""
  for path, value in OPD_PRESETS[opd].items():
    section, field = path.split('.')
    config[section][field] = value
