"""Streaming mode with multi-turn tool use (`rollout.mode='stream'` with
configs/arith_tool.py:pulse): weights swapped between the rounds of
trajectories in flight, so one trajectory holds agent tokens of two
versions, each keeping its own; a scheduled stream is the same run to run
and resumes exactly from a checkpoint. (The staleness policies on
multi-turn rows: tests/train/rollouts/test_staleness.py.)"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from configs import arith_tool
from jaxcorr.train.loop import Trainer

# Timings: everything else of a scheduled stream is reproducible.
VOLATILE = ('time/', 'perf/', 'stream/', 'agent/env_time_share')
BATCH = 16  # pulse: 4 prompts x 4 samples


def _config():
  c = arith_tool.get_config('pulse')
  c.rollout.mode = 'stream'
  c.rollout.weight_sync = 'scheduled'
  c.rollout.max_staleness = 2
  c.rollout.queue_size = 2
  # An agent turn spans rounds, so swaps fall inside trajectories.
  c.rollout.decode_chunk = 4
  c.train.num_steps = 4
  c.train.eval_every = 0
  c.train.checkpoint_every = 0  # a scheduled stream drains at checkpoints
  return c


def _train(config, workdir):
  """(the trainer after `train()`, the rollout batch of each step it
  trained)."""
  trainer = Trainer.from_config(config, str(workdir), config_name='test')
  batches = []
  train_on = trainer.train_on

  def recording(scored):
    batches.append(scored.batch)
    return train_on(scored)

  trainer.train_on = recording
  trainer.train()
  return trainer, batches


def _metrics(workdir):
  """metrics.jsonl's rows of the RL steps."""
  with open(workdir / 'metrics.jsonl') as f:
    return [r for r in map(json.loads, f) if r['step'] > 0]


def _run(workdir):
  """(metrics rows, each step's rollout batch)."""
  _, batches = _train(_config(), workdir)
  return _metrics(workdir), batches


def _stable(rows):
  return [
    {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows
  ]


@pytest.mark.slow
def test_scheduled_agent_stream_spans_versions_and_is_reproducible(tmp_path):
  rows, batches = _run(tmp_path / 'a')
  assert len(rows) == len(batches) == 4
  mixed = 0
  for step, (r, batch) in enumerate(zip(rows, batches)):
    # A pulse: every stage of a multi-turn step ran.
    assert r['agent/turns_mean'] >= 1
    assert r['agent/env_tokens_mean'] > 0
    assert r['batch/valid_tokens'] == pytest.approx(
      r['agent/agent_tokens_mean'] * BATCH
    )
    assert np.isfinite(r['actor/pg_loss'])
    assert r['rollout/staleness_max'] <= 2
    version = np.asarray(batch.policy_version)
    agent = np.asarray(batch.response_mask, bool)
    env = np.asarray(batch.context_mask, bool) & ~agent
    # Environment tokens have no version; agent tokens keep their own.
    assert (version[env] == -1).all()
    assert (version[agent] >= max(step - 2, 0)).all()
    assert (version[agent] <= step).all()
    for row in range(len(version)):
      # Each token keeps the version that sampled it: later tokens, later
      # (or the same) weights; some trajectory holds two.
      own = version[row][agent[row]]
      assert (np.diff(own) >= 0).all()
      mixed += len(set(own.tolist())) > 1
  assert mixed > 0
  assert max(r['rollout/mixed_version_fraction'] for r in rows) > 0
  assert max(r['stream/swaps_in_flight'] for r in rows) >= 1
  again, batches_again = _run(tmp_path / 'b')
  assert _stable(again) == _stable(rows)
  for a, b in zip(batches, batches_again):
    np.testing.assert_array_equal(a.policy_version, b.policy_version)
    np.testing.assert_array_equal(a.rollout_logp, b.rollout_logp)


@pytest.mark.slow
def test_agent_stream_resumes_exactly_from_a_checkpoint(tmp_path):
  """A scheduled agent stream drains at each checkpoint step, so a run
  stopped at step 2 and resumed in a fresh trainer trains on the same
  trajectories (tokens, per-token versions, log-probs) and ends with the
  same weights as the run that never stopped."""

  def config(steps):
    c = _config()
    c.train.checkpoint_every = 2
    c.train.num_steps = steps
    return c

  full, full_batches = _train(config(4), tmp_path / 'full')
  _, first = _train(config(2), tmp_path / 'part')
  resumed, rest = _train(config(4), tmp_path / 'part')
  assert resumed.step == 4 and len(first) == len(rest) == 2
  for a, b in zip(full_batches, first + rest):
    for field in (
      'response_tokens',
      'context_mask',
      'response_mask',
      'policy_version',
      'rollout_logp',
    ):
      np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
  for a, b in zip(
    jax.tree.leaves(jax.device_get(full.state.params)),
    jax.tree.leaves(jax.device_get(resumed.state.params)),
  ):
    np.testing.assert_array_equal(a, b)
  full_rows = _stable(_metrics(tmp_path / 'full'))
  assert _stable(_metrics(tmp_path / 'part')) == full_rows
