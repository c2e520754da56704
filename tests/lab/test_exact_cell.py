"""The exact-mode cell of the mismatch lab (jaxcorr/lab/exact.py): its
runs build, and its claim on a pulse-sized run: under `rollout.exact` at
staleness 0 a correction preset trains exactly like no correction."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxcorr import lab
from jaxcorr.lab import exact as cell
from jaxcorr.train import build
from jaxcorr.train.loop import Trainer
from tests.helpers.trainer_config import pulse_config


def test_cell_runs_build():
  """Every run of the cell passes the trainer's start-up validation, in
  exact mode, at the staleness its mismatch names (one seed of each: the
  seed changes no rule)."""
  runs = [(g, key) for g in cell.plan() for key in g.runs()]
  assert len({key for _, key in runs}) == len(runs) == 30
  assert {key[2] for _, key in runs} == set(cell.SEEDS)
  for grid, (preset, mismatch, seed) in runs:
    if seed != cell.SEEDS[-1]:
      continue
    config = lab.make_config(
      preset, mismatch, seed=seed, small=grid.small, **grid.overrides
    )
    run = build.build(config)
    assert run.rollout.exact == mismatch.startswith('exact')
    assert run.rollout.max_staleness == (
      int(mismatch[-1]) if 'stale' in mismatch else None
    )
    assert run.train.num_steps == 25
    assert config.correction.enabled == (preset != lab.OFF)


def test_gap_reads_fresh_and_stale_steps():
  zero = {f'rollout_corr/{k}': v for k, v in cell.GAP_METRICS.items()}
  rows = [
    {'step': 0},  # eval only
    {**zero, 'rollout/staleness_max': 0.0},
    {**zero, 'rollout/staleness_max': 2.0, 'rollout_corr/k3_kl': 0.02},
    {**zero, 'rollout/staleness_max': 1.0, 'rollout_corr/ppl_ratio': 0.9},
    {'rollout_corr/kl': 0.0, 'rollout_corr/k3_kl': 0.0},  # no IS or RS
  ]
  got = cell.gap(rows)
  assert got['fresh'] == 0.0
  assert got['stale'] == pytest.approx(0.1)
  assert got['stale_k3'] == pytest.approx(0.01)
  assert cell.gap([{'step': 1}]) == dict(fresh=None, stale=None, stale_k3=None)


def _final_params(preset: str, tmp_path, **overrides) -> list[np.ndarray]:
  config = pulse_config(
    preset,
    length_reward=True,
    train__num_steps=2,
    train__eval_at_start=False,
    **overrides,
  )
  workdir = tmp_path / f'{preset}_{len(list(tmp_path.iterdir()))}'
  trainer = Trainer.from_config(config, str(workdir), config_name='test')
  try:
    trainer.train()
    params = nnx.to_pure_dict(trainer.state.params)
  finally:
    trainer.close()
  return [np.asarray(x) for x in jax.tree.leaves(params)]


def test_correction_changes_nothing_at_staleness_0_in_exact_mode(tmp_path):
  """slime_mis (token TIS with a lower bound, token RS, veto, batch
  normalisation) against no correction: with μ == π_old every weight is
  exactly 1, nothing is clipped, masked or rejected, and the params after
  two steps are equal bit for bit (without exact mode they differ)."""
  none = _final_params(
    'disabled', tmp_path, correction__enabled=False, rollout__exact=True
  )
  mis = _final_params('slime_mis', tmp_path, rollout__exact=True)
  assert len(none) == len(mis) > 0
  assert all(np.array_equal(a, b) for a, b in zip(none, mis))
