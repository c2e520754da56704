"""The trainer end to end on the tiny arithmetic task (8 fake CPU devices).

"Has a pulse" runs for a decoupled and a bypass preset and for async mode,
exact resume, reward-function failures, and the metrics.jsonl contract
(`step`, `reward/mean`, every `rollout_corr/` metric of the preset).
"""

from __future__ import annotations

import glob
import json
import math
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from jaxcorr import export
from jaxcorr import rewards as reward_fns
from jaxcorr.losses import correction as corr_lib
from jaxcorr.model import load_hf
from jaxcorr.train.loop import Trainer
from tests.helpers.program_keys import program_keys
from tests.helpers.trainer_config import pulse_config

VOLATILE = ('time/', 'perf/')


def _read(workdir) -> list[dict]:
  with open(workdir / 'metrics.jsonl') as f:
    return [json.loads(line) for line in f]


def _stable(rows: list[dict]) -> list[dict]:
  return [
    {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows
  ]


def _train(config, workdir):
  trainer = Trainer.from_config(config, str(workdir), config_name='test')
  last = trainer.train()
  return trainer, last


def _expected_corr_metrics(trainer) -> set[str]:
  """The `rollout_corr/` keys the preset's correction emits."""
  corr = trainer.run.losses.correction
  b, t = 4, 5
  mask = np.ones((b, t), bool)
  logp = np.full((b, t), -1.0, np.float32)
  out = corr_lib.rollout_correction(logp, logp, mask, corr)
  return set(out.metrics)


@pytest.mark.parametrize(
  'preset, eval_at_start',
  [
    ('decoupled_seq_is_rs', True),
    # Also: no start-up evaluation (train.eval_at_start).
    ('bypass_pg_geo_rs', False),
    # Diagnostics only: the two above cover both loss paths.
    pytest.param('disabled', True, marks=pytest.mark.slow),
  ],
)
def test_pulse_sync(tmp_path, preset, eval_at_start):
  config = pulse_config(preset, length_reward=True)
  config.train.eval_at_start = eval_at_start
  trainer, last = _train(config, tmp_path)
  rows = _read(tmp_path)
  steps = [r['step'] for r in rows]
  # An evaluation at 0 (unless turned off), then num_steps RL steps.
  assert steps == ([0, 1, 2, 3] if eval_at_start else [1, 2, 3])
  rl_rows = rows[1:] if eval_at_start else rows
  corr_keys = _expected_corr_metrics(trainer)
  assert corr_keys  # the preset emits diagnostics
  for r in rl_rows:
    assert 'reward/mean' in r
    assert corr_keys <= set(r), corr_keys - set(r)
    for k in ('actor/pg_loss', 'actor/grad_norm', 'time/rollout'):
      assert math.isfinite(r[k]), k
  assert 'eval/accuracy' in rows[-1]
  assert trainer.engine.policy_version == 3
  assert last['actor/grad_norm'] > 0
  # One trace (hence one compilation) of each step function, whatever the
  # step: every batch is padded to one shape and the state keeps its
  # shardings.
  assert trainer.steps.traces == {'prepare': 1, 'update': 1}
  # Nor a second executable for other input shardings (the fast-path cache
  # can be empty when calls took the slow path, e.g. under pytest-xdist).
  assert trainer.steps.update._cache_size() <= 1


def test_pulse_replay(tmp_path):
  """logprob_mode='replay': the engine's kept sets reach the trainer, whose
  π_old is renormalised over them (rollout/kept_set.py)."""
  config = pulse_config(
    'decoupled_seq_is_rs',
    length_reward=True,
    rollout__logprob_mode='replay',
    rollout__top_p=0.8,
  )
  trainer, last = _train(config, tmp_path)
  rows = [r for r in _read(tmp_path) if r['step'] > 0]
  assert len(rows) == 3
  vocab = trainer.engine.config.vocab_size
  assert trainer.engine.kept_set_capacity == min(64, vocab)
  for r in rows:
    assert math.isfinite(r['actor/pg_loss']), r
    # π_old and μ both live on K_t: same weights, ratio 1 despite top-p.
    assert abs(r['rollout_corr/kl']) < 1e-5, r['rollout_corr/kl']
    # top_p=0.8 keeps at least 80% of the engine's mass, never all of it
    # on every token; no set reaches the capacity (V <= 64).
    assert 0.8 - 1e-6 <= r['replay/kept_mass_min'] <= 1.0, r
    assert r['replay/kept_mass_mean'] < 1.0, r
    assert 1 <= r['replay/set_size_mean'] <= r['replay/set_size_max'] <= vocab
    assert r['replay/capped_fraction'] == 0.0
  assert last['actor/grad_norm'] > 0


def test_pulse_async_bounded_staleness(tmp_path):
  config = pulse_config(
    'decoupled_token_is',
    length_reward=True,
    rollout__mode='async',
    rollout__max_staleness=1,
    rollout__rollout_devices=2,
    train__num_steps=4,
  )
  trainer, _ = _train(config, tmp_path)
  rows = [r for r in _read(tmp_path) if r['step'] > 0]
  assert len(rows) == 4
  assert trainer.rollout_mesh.devices.size == 2
  assert trainer.mesh.devices.size == 6
  for r in rows:
    assert r['rollout/staleness_max'] <= 1
    assert r['rollout/stale_dropped_fraction'] == 0
  # Fixed lag: batch s is sampled by version max(s - 1, 0).
  assert [r['rollout/policy_version'] for r in rows] == [0, 0, 1, 2]
  assert [r['rollout/staleness_max'] for r in rows] == [0, 1, 1, 1]


def test_resume_is_exact(tmp_path):
  full, part = tmp_path / 'full', tmp_path / 'part'
  # No evaluation: the stopped run's final eval is not part of the full run.
  kw = dict(train__num_steps=4, train__checkpoint_every=2, train__eval_every=0)
  # test_pulse_sync's first preset: its programs are in the session's
  # compile cache (tests/conftest.py); any preset resumes alike.
  preset = 'decoupled_seq_is_rs'
  with program_keys('jit__prepare') as fresh:
    t_full, _ = _train(pulse_config(preset, length_reward=True, **kw), full)
    # Run 2 of 4 steps, stop, then resume in a fresh trainer.
    _train(
      pulse_config(preset, length_reward=True, **dict(kw, train__num_steps=2)),
      part,
    )
  with program_keys('jit__prepare') as resumed:
    t_resumed, _ = _train(pulse_config(preset, length_reward=True, **kw), part)
  assert t_resumed.step == 4
  # One prepare program, fresh (SFT's params, then the update's) or
  # resumed (restored ones): one compile, which the resumed run loads from
  # the compile cache (issue 38: it compiled its own).
  assert len(fresh) == 2 and len(set(fresh)) == 1, fresh
  assert resumed == fresh[:1], (fresh, resumed)
  a = jax.tree.leaves(jax.device_get(t_full.state.params))
  b = jax.tree.leaves(jax.device_get(t_resumed.state.params))
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  assert _stable(_read(full)) == _stable(_read(part))


def test_reward_failure_scores_zero_and_counts_then_stops(tmp_path):
  name = 'test_always_raises'
  if name not in reward_fns.REWARDS:

    @reward_fns.register(name)
    def _raises(response: str, answer: str) -> float:
      raise RuntimeError('boom')

  # A preset test_pulse_sync compiled (tests/conftest.py caches programs);
  # rewards are computed on the host, outside them.
  config = pulse_config(
    'decoupled_seq_is_rs', reward__functions=f'exact_match,{name}:0.5'
  )
  # It fails on every row: those score 0 and count, and after
  # FAILING_SCORES such batches in a row (evaluations included) the run
  # stops naming it, rather than going on training on zeros.
  with pytest.raises(reward_fns.RewardFunctionFailing, match=repr(name)):
    _train(config, tmp_path)
  rows = [r for r in _read(tmp_path) if r['step'] > 0]
  assert 1 <= len(rows) < reward_fns.scorer.FAILING_SCORES
  for r in rows:
    assert r['reward/failures'] == 16  # every row of the batch
    assert r[f'reward/{name}/mean'] == 0


def test_step_breakdown_metrics_and_export(tmp_path):
  """One run checked twice (a run costs a compile): the metrics a step
  writes, and `jaxcorr.export` of its last checkpoint to a HF directory that
  `load_hf` reads back as the same model."""
  trainer, _ = _train(
    pulse_config(
      'bypass_ppo_clip', length_reward=True, train__profile_steps='2'
    ),
    tmp_path / 'run',
  )
  r = _read(tmp_path / 'run')[-1]
  # train.profile_steps: step 2's trace, for TensorBoard and Perfetto.
  traces = glob.glob(str(tmp_path / 'run/profile/plugins/profile/*/*'))
  assert any(t.endswith('.xplane.pb') for t in traces), traces
  assert any(t.endswith('.trace.json.gz') for t in traces), traces
  for k in (
    'time/rollout',
    'time/prepare',
    'time/update',
    'time/train_host',
    'time/train_device',
    'time/weight_sync',
    'time/step',
    'perf/tokens_per_s',
    'rollout/staleness_mean',
    'rollout/finish_stop_fraction',
    'response_length/mean',
    'actor/lr',
  ):
    assert k in r, k
  step = export.export(str(tmp_path / 'run'), str(tmp_path / 'hf'))
  assert step == trainer.step == 3
  loaded = load_hf(tmp_path / 'hf')
  trained = nnx.merge(trainer.graphdef, trainer.state.params)
  # Same weights bit for bit; the logits differ only by the reduction
  # order of an 8-device vs a 1-device forward.
  a = jax.tree.leaves(jax.device_get(nnx.state(loaded, nnx.Param)))
  b = jax.tree.leaves(jax.device_get(nnx.state(trained, nnx.Param)))
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  tokens = np.arange(2 * 8, dtype=np.int32).reshape(2, 8) % 27
  np.testing.assert_allclose(
    np.asarray(loaded(tokens)), np.asarray(trained(tokens)), atol=1e-5
  )


def test_restore_to_step_0_writes_each_step_once(tmp_path):
  """A run killed before its first periodic checkpoint restores step 0
  (checkpoint 0, after SFT, precedes step 0's evaluation line): each step of
  metrics.jsonl appears once."""
  # The same preset and shapes as test_resume_is_exact (compile cache).
  config = pulse_config(
    'decoupled_seq_is_rs',
    length_reward=True,
    train__num_steps=2,
    train__checkpoint_every=0,
    train__eval_every=1,
  )
  _train(config, tmp_path)
  assert [r['step'] for r in _read(tmp_path)] == [0, 1, 2]
  # SIGKILL before the final checkpoint: only checkpoint 0 is on disk.
  shutil.rmtree(tmp_path / 'checkpoints' / '2')
  trainer, _ = _train(config, tmp_path)
  assert trainer.step == 2
  assert [r['step'] for r in _read(tmp_path)] == [0, 1, 2]
