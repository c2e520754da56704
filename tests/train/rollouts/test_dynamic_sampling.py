"""Dynamic sampling in the trainer (jaxcorr/train/rollouts/dynamic_sampling.py):
config-time errors, and 2-step pulse runs in each rollout mode whose
filter metric drops about half the groups, so steps take several
generation rounds; the sync run is resumed and must equal the
uninterrupted one (the back-fill is a function of the seed and the loader
position, which counts the dropped groups' prompts). The decisions
themselves are checked against verl and NeMo-RL in
tests/conformance/dynamic_sampling.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from configs import arith_tool
from jaxcorr import rewards as reward_fns
from jaxcorr.train import build
from jaxcorr.train.loop import Trainer
from tests.helpers.trainer_config import pulse_config

HALF = 'test_length_if_even_answer'
"""The response's length when the prompt's answer is even, else 0: the
odd-answer groups never vary (dropped), the others almost always do."""

if HALF not in reward_fns.REWARDS:
  reward_fns.register(HALF)(
    lambda response, answer: (
      float(len(response)) if answer.strip()[-1:] in tuple('02468') else 0.0
    )
  )

DS = dict(
  reward__functions=f'exact_match,{HALF}:0.1',
  dynamic_sampling__enabled=True,
  dynamic_sampling__metric=HALF,
  dynamic_sampling__max_gen_rounds=6,
  dynamic_sampling__at_cap='fill_dropped',
  train__num_steps=2,
  train__eval_every=0,
)
KEYS = (
  'groups_kept',
  'groups_dropped',
  'groups_filled_dropped',
  'gen_rounds',
  'prompts_consumed',
)


def _train(config, workdir):
  trainer = Trainer.from_config(config, str(workdir), config_name='test')
  trainer.train()
  with open(workdir / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f]
  return trainer, [r for r in rows if r['step'] > 0]


def _consumed(rows) -> int:
  """Prompts drawn by the steps' rounds (4 per round, kept or dropped)."""
  for r in rows:
    kept, dropped, filled, rounds, consumed = (
      r[f'dynamic_sampling/{k}'] for k in KEYS
    )
    assert consumed == kept + dropped == 4 * rounds
    assert filled == max(0, 4 - kept)
  return int(sum(r['dynamic_sampling/prompts_consumed'] for r in rows))


def _assert_backfilled(trainer, rows):
  assert _consumed(rows) > 4 * len(rows)  # some step drew a second round
  assert trainer.loader.state()['position'] == _consumed(rows)


@pytest.mark.parametrize(
  'overrides, why',
  [
    (
      dict(dynamic_sampling__metric='accuracy'),
      r"config\.dynamic_sampling\.metric: invalid value 'accuracy'.*'reward'",
    ),
    (
      dict(rollout__samples_per_prompt=1),
      r'config\.dynamic_sampling\.enabled: .*samples_per_prompt=1',
    ),
    (
      dict(dynamic_sampling__max_gen_rounds=0),
      r'config\.dynamic_sampling\.max_gen_rounds: invalid value 0',
    ),
    (
      dict(dynamic_sampling__at_cap='pad'),
      r"config\.dynamic_sampling\.at_cap: invalid value 'pad'",
    ),
  ],
)
def test_bad_settings_are_config_errors(overrides, why):
  with pytest.raises(ValueError, match=why):
    build.build(pulse_config(**{**DS, **overrides}))


def test_metric_names_a_reward_function_or_the_reward():
  for metric in ('reward', 'exact_match', HALF):
    run = build.build(
      pulse_config(**{**DS, 'dynamic_sampling__metric': metric})
    )
    assert run.dynamic_sampling.metric == metric


def test_sync_backfills_and_resumes_exactly(tmp_path):
  """Fresh 2 steps == 1 step, stopped, then resumed for the second; the
  preset of tests/train/test_loop.py's resume test (compile cache)."""
  kw = dict(DS, train__checkpoint_every=1)
  preset = 'decoupled_seq_is_rs'
  full, rows = _train(pulse_config(preset, **kw), tmp_path / 'full')
  _assert_backfilled(full, rows)
  _train(pulse_config(preset, **dict(kw, train__num_steps=1)), tmp_path / 'p')
  part, part_rows = _train(pulse_config(preset, **kw), tmp_path / 'p')
  assert part.loader.state() == full.loader.state()
  a = jax.tree.leaves(jax.device_get(full.state.params))
  b = jax.tree.leaves(jax.device_get(part.state.params))
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  stable = lambda rs: [  # noqa: E731
    {k: v for k, v in r.items() if not k.startswith(('time/', 'perf/'))}
    for r in rs
  ]
  assert stable(rows) == stable(part_rows)


@pytest.mark.parametrize(
  'mode',
  [
    # Fixed lag, with packed rows (the rounds' prompt widths differ).
    dict(rollout__mode='async', rollout__max_staleness=1, train__packing=True),
    # In stream the back-fill runs at the producer.
    dict(rollout__mode='stream', rollout__max_staleness=1),
  ],
  ids=['async_packed', 'stream'],
)
def test_async_modes_backfill(tmp_path, mode):
  trainer, rows = _train(
    pulse_config('decoupled_token_is', **DS, **mode), tmp_path
  )
  assert len(rows) == 2
  _assert_backfilled(trainer, rows)
  for r in rows:
    assert r['batch/valid_tokens'] > 0
    assert np.isfinite(r['actor/pg_loss'])


# Slow (~100 s here, the agent programs' compile): the filter sees only a
# group's metric values, whatever its rows hold; the sync test above
# covers the trainer's path, tests/conformance/dynamic_sampling the rows.
@pytest.mark.slow
def test_multi_turn_rows_are_kept_by_whole_groups(tmp_path):
  """configs/arith_tool.py:pulse (tool-using trajectories), sync: every
  group of the batches trained varies in the metric, rows of a group
  adjacent under one new id."""
  c = arith_tool.get_config('pulse')
  for key, value in DS.items():
    section, field = key.split('__')
    c[section][field] = value
  trainer = Trainer.from_config(c, str(tmp_path), config_name='test')
  trained = []
  train_on = trainer.train_on

  def recording(scored):
    trained.append(scored)
    return train_on(scored)

  trainer.train_on = recording
  trainer.train()
  with open(tmp_path / 'metrics.jsonl') as f:
    rows = [r for r in map(json.loads, f) if r['step'] > 0]
  _assert_backfilled(trainer, rows)
  metric = trainer.run.reward.functions.split(',').index(f'{HALF}:0.1')
  for scored, r in zip(trained, rows):
    groups = scored.scores[metric].reshape(4, 4)
    varies = groups.max(1) > groups.min(1)
    assert varies.sum() == 4 - r['dynamic_sampling/groups_filled_dropped']
    ids = np.asarray(scored.batch.group_id)
    assert ids.tolist() == np.repeat(np.arange(4), 4).tolist()
