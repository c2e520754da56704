"""The trainer end to end with multi-turn tool use (configs/arith_tool.py,
the calculator environment on the from-scratch arithmetic model): a pulse
in the default run, fixed-lag async trajectories, exact resume in sync
mode (slow). Stream mode: tests/train/rollouts/test_stream_agents.py."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from configs import arith_tool
from jaxcorr.agents.tool_runner import OUTCOMES
from jaxcorr.train.loop import Trainer

VOLATILE = ('time/', 'perf/', 'agent/env_time_share')


def _config(**overrides):
  c = arith_tool.get_config('pulse')
  for path, value in overrides.items():
    section, field = path.split('__')
    c[section][field] = value
  return c


def _train(config, workdir):
  trainer = Trainer.from_config(config, str(workdir), config_name='test')
  trainer.train()
  return trainer


def _read(workdir) -> list[dict]:
  with open(workdir / 'metrics.jsonl') as f:
    return [json.loads(line) for line in f]


def test_arith_tool_has_a_pulse(tmp_path):
  _train(_config(train__num_steps=2, train__eval_every=0), tmp_path)
  rows = [r for r in _read(tmp_path) if r['step'] > 0]
  assert len(rows) == 2
  batch = 16  # pulse: 4 prompts x 4 samples
  for r in rows:
    assert r['agent/turns_mean'] >= 1
    assert r['agent/env_tokens_mean'] > 0  # some turns got observations
    # The step's own calls: not the SFT warm-up's demonstrations.
    outcomes = [r[f'agent/tool_{o}'] for o in OUTCOMES]
    assert sum(outcomes) == r['agent/tool_calls'] > 0
    # Only agent tokens train: the update's tokens are the agent's.
    assert r['batch/valid_tokens'] == pytest.approx(
      r['agent/agent_tokens_mean'] * batch
    )
    # The engine's μ on agent tokens is the trainer's π (same ids).
    assert abs(r['rollout_corr/kl']) < 1e-4
    assert np.isfinite(r['actor/pg_loss'])


def test_fixed_lag_agents_sample_with_the_lagged_version(tmp_path):
  """`rollout.mode='async'`: each batch's trajectories, every turn, are
  sampled by version max(s - k, 0), so every agent token is exactly k
  behind once the pipeline is full."""
  config = _config(
    rollout__mode='async',
    rollout__max_staleness=1,
    train__num_steps=3,
    train__eval_every=0,
  )
  _train(config, tmp_path)
  rows = [r for r in _read(tmp_path) if r['step'] > 0]
  assert len(rows) == 3
  assert [r['staleness/token_max'] for r in rows] == [0, 1, 1]
  assert [r['staleness/token_mean'] for r in rows] == [0, 1, 1]
  for r in rows:
    assert r['agent/turns_mean'] >= 1
    assert r['rollout/mixed_version_fraction'] == 0  # one version a batch
    assert np.isfinite(r['actor/pg_loss'])


@pytest.mark.slow
def test_agent_resume_is_exact(tmp_path):
  full, part = tmp_path / 'full', tmp_path / 'part'
  kw = dict(train__num_steps=4, train__checkpoint_every=2, train__eval_every=0)
  t_full = _train(_config(**kw), full)
  _train(_config(**dict(kw, train__num_steps=2)), part)
  t_resumed = _train(_config(**kw), part)
  assert t_resumed.step == 4
  a = jax.tree.leaves(jax.device_get(t_full.state.params))
  b = jax.tree.leaves(jax.device_get(t_resumed.state.params))
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)

  def stable(rows):
    return [
      {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows
    ]

  assert stable(_read(full)) == stable(_read(part))
