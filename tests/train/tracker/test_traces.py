"""`train.trace_every` traces (jaxcorr/train/tracker/traces.py): the file
format's round trip, the size cap, resume, the reasons, and a trainer run
that writes them."""

from __future__ import annotations

import json
import math

import numpy as np

from jaxcorr.train.loop import Trainer
from jaxcorr.train.tracker import traces
from tests.helpers.dashboard_workdir import trace_row
from tests.helpers.trainer_config import pulse_config


def test_round_trip(tmp_path):
  rows = [trace_row(3, r, 6) for r in range(2)]
  rows[0]['mu'][0] = None  # a non-finite number is null
  traces.TraceWriter(str(tmp_path), max_mb=1).write(3, rows)
  assert traces.trace_steps(str(tmp_path)) == [3]
  assert traces.read_trace(str(tmp_path), 3) == rows
  # Written whole: no temporary file is left beside it.
  assert [p.name for p in (tmp_path / 'traces').iterdir()] == ['step_3.jsonl']


def test_size_cap_deletes_the_oldest_steps(tmp_path):
  rows = [trace_row(1, r, 200) for r in range(4)]
  one = len(''.join(json.dumps(r) + '\n' for r in rows))
  cap_mb = 2.5 * one / 2**20  # room for two steps, not three
  writer = traces.TraceWriter(str(tmp_path), max_mb=cap_mb)
  for step in (1, 2, 3, 4):
    writer.write(step, rows)
  assert traces.trace_steps(str(tmp_path)) == [3, 4]
  # A writer reopened on the folder counts what is there.
  again = traces.TraceWriter(str(tmp_path), max_mb=cap_mb)
  again.write(5, rows)
  assert traces.trace_steps(str(tmp_path)) == [4, 5]


def test_resume_drops_the_steps_after_the_checkpoint(tmp_path):
  writer = traces.TraceWriter(str(tmp_path), max_mb=1)
  for step in (2, 4, 6):
    writer.write(step, [trace_row(step, 0, 4)])
  traces.TraceWriter(str(tmp_path), max_mb=1).resume(4)
  assert traces.trace_steps(str(tmp_path)) == [2, 4]
  traces.TraceWriter(str(tmp_path), max_mb=1).resume(0)
  assert traces.trace_steps(str(tmp_path)) == []


def test_disabled_writer_writes_nothing(tmp_path):
  traces.TraceWriter(str(tmp_path), max_mb=1, enabled=False).write(
    1, [trace_row(1, 0, 4)]
  )
  assert traces.trace_steps(str(tmp_path)) == []


def test_token_reasons():
  ctx = np.array([1, 1, 1, 1, 0], bool)
  agent = np.array([1, 1, 0, 1, 0], bool)
  trains = np.array([1, 0, 0, 1, 0], bool)  # token 1: masked stale
  corr = np.array([1, 1, 1, 0, 0], bool)
  assert traces.token_reasons(ctx, agent, trains, True, corr) == [
    '',
    'stale',
    'env',
    'token_rejected',
    '',
  ]
  none = np.zeros(5, bool)
  assert traces.token_reasons(ctx, agent, trains, True, none)[::3] == [
    'seq_rejected',
    'seq_rejected',
  ]
  assert traces.token_reasons(ctx, agent, none, False, None)[0] == (
    'row_dropped'
  )


def test_select_rows():
  live = np.array([1, 0, 1, 1, 1, 0, 1], bool)
  a = traces.select_rows(live, 3, seed=0, step=5)
  assert len(a) == 3 and live[a].all() and list(a) == sorted(a)
  assert list(a) == list(traces.select_rows(live, 3, seed=0, step=5))
  assert list(traces.select_rows(live, 9, 0, 5)) == [0, 2, 3, 4, 6]


def test_trainer_writes_traces_on_trace_steps_only(tmp_path):
  config = pulse_config(
    'decoupled_seq_is_rs',
    length_reward=True,
    train__num_steps=2,
    train__trace_every=2,
    train__trace_rows=3,
    train__eval_every=0,
  )
  trainer = Trainer.from_config(config, str(tmp_path), config_name='test')
  trainer.train()
  assert traces.trace_steps(str(tmp_path)) == [2]
  # Its time is its own, out of the update's.
  text = (tmp_path / 'metrics.jsonl').read_text()
  logged = [json.loads(line) for line in text.splitlines()]
  assert ['time/trace' in r for r in logged] == [False, True]
  rows = traces.read_trace(str(tmp_path), 2)
  assert len(rows) == 3
  tok = trainer.tokenizer
  for r in rows:
    n = len(r['ids'])
    assert n > 0 and r['step'] == 2 and r['trainer_version'] == 1
    for k in ('pieces', 'agent', 'mu', 'pi_old', 'pi_theta', 'weight'):
      assert len(r[k]) == n, k
    assert r['pieces'] == [tok.decode([i]) for i in r['ids']]
    assert set(r['rewards']) == {'exact_match', 'test_response_length'}
    trained = [t for t in range(n) if r['reason'][t] == '']
    assert trained, r['reason']
    for t in trained:
      # The sync pulse: π_old is the engine's μ up to float error, and its
      # weight is the truncated exp(π_old − μ).
      assert math.isclose(r['pi_old'][t], r['mu'][t], abs_tol=1e-4)
      assert math.isclose(r['weight'][t], 1.0, abs_tol=1e-3)
      assert r['staleness'][t] == 0 and r['version'][t] == 1
      assert r['pi_theta'][t] is not None
