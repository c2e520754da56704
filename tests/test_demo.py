"""The main job (`python -m jaxcorr.demo`) has a pulse."""

import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import base as base_config
from jaxcorr import demo
from jaxcorr.train import build

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize('mismatch', ['none', 'bf16', 'stale', 'int8'])
def test_simulated_batch_is_consistent(mismatch):
  batch = demo.simulate(jax.random.key(0), mismatch, 8, 12, 16)
  mask = np.asarray(batch['mask'])
  assert mask.dtype == bool and mask[:, 0].all()
  gap = np.abs(np.asarray(batch['old_logp']) - batch['rollout_logp'])[mask]
  if mismatch == 'none':
    assert gap.max() == 0.0
  else:
    assert gap.max() > 0.0  # the engine really differs from the trainer


@pytest.mark.parametrize(
  'preset', ['disabled', 'decoupled_geo_rs_token_tis', 'bypass_pg_is']
)
def test_step_is_finite_and_corrects(preset):
  batch = demo.simulate(jax.random.key(1), 'bf16', 16, 24, 32)
  cfgs = build.losses(base_config.get_config(preset))
  loss, gnorm, metrics = demo.make_step(cfgs.actor, cfgs.correction)(batch)
  assert np.isfinite(loss) and np.isfinite(gnorm) and gnorm > 0
  assert all(np.isfinite(v) for v in metrics.values())
  assert metrics['rollout_corr/kl'] != 0.0


def _run_cli(*flags: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, '-m', 'jaxcorr.demo', *flags],
    capture_output=True,
    text=True,
    timeout=300,
    env={'JAX_PLATFORMS': 'cpu', 'PATH': '/usr/bin:/bin'},
    cwd=ROOT,
  )


def test_cli_runs_one_preset():
  out = _run_cli(
    '--config=configs/base.py:slime_mis',
    '--batch=8',
    '--seq_len=8',
    '--config.correction.is_upper=3.0',
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert '(--config)' in out.stdout and 'decoupled' in out.stdout


def test_cli_config_typo_fails_loudly():
  out = _run_cli(
    '--config=configs/base.py:slime_mis', '--config.correction.is_uper=3.0'
  )
  assert out.returncode != 0
  assert 'is_uper' in out.stderr
