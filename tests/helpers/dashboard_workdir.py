"""A run's workdir for the dashboard's tests and bench/dashboard.py,
written with the trainer's own writers (`MetricWriter`, `TraceWriter`,
`samples_log.write`) and values that a test can look for.

`write_workdir(path, steps)`: metrics of steps 1..steps (reward/mean =
`reward_at(step)`, the correction and timing metrics, staleness
histograms), eval samples at the last step, and a trace at the last step
whose row `KNOWN_ROW` has the token `KNOWN_PIECE` at position
`KNOWN_TOKEN` with weight `KNOWN_WEIGHT`.
"""

from __future__ import annotations

import math

from jaxcorr.train.evals import samples_log
from jaxcorr.train.tracker import metrics as metrics_lib
from jaxcorr.train.tracker import traces

KNOWN_ROW, KNOWN_TOKEN, KNOWN_PIECE, KNOWN_WEIGHT = 1, 2, 'Z', 2.0


def reward_at(step: int) -> float:
  return round(0.2 + 0.5 * step / (step + 10), 6)


def step_metrics(step: int) -> dict[str, float]:
  wave = math.sin(step / 7.0)
  out = {
    'reward/mean': reward_at(step),
    'rollout_corr/kl': 1e-3 * (1 + wave),
    'rollout_corr/k3_kl': 5e-4 * (1 + wave),
    'rollout_corr/rollout_is_eff_sample_size': 0.9 + 0.05 * wave,
    'rollout_corr/rollout_is_min': 0.5,
    'rollout_corr/rollout_is_mean': 1.0,
    'rollout_corr/rollout_is_max': 2.0 + wave,
    'rollout_corr/rejected_token_fraction': 0.01 * (1 + wave),
    'rollout_corr/rejected_seq_fraction': 0.02,
    'rollout/staleness_mean': 0.5,
    'rollout/staleness_max': 2,
    'staleness/token_hist0': 0.6,
    'staleness/token_hist1': 0.3,
    'staleness/token_hist2': 0.1,
    'time/rollout': 1.5,
    'time/prepare': 0.2,
    'time/update': 0.8,
  }
  # The other metrics of a real step (a real line holds ~100).
  out.update({f'actor/extra_{i}': 0.001 * i * step for i in range(80)})
  return out


def trace_row(step: int, row: int, length: int) -> dict:
  """A trace row in traces.py's format: agent tokens, then two of the
  environment's; μ and π_old apart by 0.01·t."""
  agent = [1] * (length - 2) + [0, 0]
  mu = [-1.0 - 0.01 * t if a else None for t, a in enumerate(agent)]
  pi_old = [m + 0.01 * t if m is not None else None for t, m in enumerate(mu)]
  weight = [1.0 if a else None for a in agent]
  pieces = [chr(ord('a') + t % 26) for t in range(length)]
  if row == KNOWN_ROW:
    weight[KNOWN_TOKEN], pieces[KNOWN_TOKEN] = KNOWN_WEIGHT, KNOWN_PIECE
  return {
    'step': step,
    'trainer_version': step - 1,
    'row': row,
    'group': row // 2,
    'sample': row % 2,
    'finish': 'STOP',
    'prompt': f'{row}+{row}=',
    'reward': float(row % 2),
    'seq_reward': float(row % 2),
    'rewards': {'exact_match': float(row % 2)},
    'ids': list(range(length)),
    'pieces': pieces,
    'agent': agent,
    'mu': mu,
    'pi_old': pi_old,
    'pi_theta': pi_old,
    'weight': weight,
    'reason': ['' if a else 'env' for a in agent],
    'version': [step - 1 if a else None for a in agent],
    'staleness': [0 if a else None for a in agent],
    'advantage': [0.5 if a else None for a in agent],
  }


def write_workdir(
  path: str,
  steps: int,
  *,
  trace_rows: int = 4,
  trace_len: int = 12,
  samples: int = 20,
) -> None:
  with metrics_lib.MetricWriter(path) as writer:
    for s in range(1, steps + 1):
      extra = {'eval/accuracy': reward_at(s) / 2} if s % 10 == 0 else {}
      writer.write(s, {**step_metrics(s), **extra})
  rows = [trace_row(steps, r, trace_len) for r in range(trace_rows)]
  traces.TraceWriter(path, max_mb=1024).write(steps, rows)
  rows = [
    {
      'step': steps,
      'set': '',
      'mode': 'greedy',
      'prompt_index': i,
      'sample': 0,
      'prompt': f'{i}+{i}=',
      'answer': str(2 * i),
      'reply': str(2 * i + i % 2),
      'reward': float(i % 2 == 0),
      'score': float(i % 2 == 0),
    }
    for i in range(samples)
  ]
  samples_log.write(f'{path}/{samples_log.DIRNAME}', steps, rows)
