"""The dashboard's reading of a live workdir (jaxcorr/dashboard/data.py):
metrics.jsonl tailed as the trainer's writer appends, a line in progress,
a rewrite by resume, and the statuses of missing and empty workdirs."""

from __future__ import annotations

from starlette.testclient import TestClient

from jaxcorr.dashboard import data
from jaxcorr.dashboard.app import Dashboard
from jaxcorr.train.tracker.metrics import MetricWriter
from tests.helpers import dashboard_workdir as wd


def _reward(run: data.Run) -> list[list]:
  run.metrics.refresh()
  return run.metrics.series(['reward/mean'])['reward/mean']


def test_tails_the_writer_and_follows_a_resume(tmp_path):
  run = data.Run(str(tmp_path), 'r')
  assert run.status()['status'] == 'empty'
  writer = MetricWriter(str(tmp_path))
  for s in (1, 2):
    writer.write(s, {'reward/mean': s / 10})
  assert _reward(run) == [[1, 2], [0.1, 0.2]]
  writer.write(3, {'reward/mean': float('nan')})
  assert _reward(run) == [[1, 2, 3], [0.1, 0.2, None]]
  # A resume from step 1 rewrites the file, longer by the next poll than
  # the one read: the reader sees its last line gone and starts over.
  writer.resume(1)
  for s in (2, 3, 4):
    writer.write(s, {'reward/mean': s / 10 + 0.3})
  assert _reward(run) == [[1, 2, 3, 4], [0.1, 0.5, 0.6, 0.7]]
  writer.close()


def test_a_line_in_progress_waits_for_its_newline(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  path.write_text('{"step": 1, "reward/mean": 0.25}\n{"step": 2, "rew')
  run = data.Run(str(tmp_path), 'r')
  status = run.status()
  assert status['status'] == 'ok'
  assert any('being written' in n for n in status['notes'])
  assert _reward(run) == [[1], [0.25]]
  with open(path, 'a') as f:
    f.write('ard/mean": 0.5}\nnot json\n')
  assert _reward(run) == [[1, 2], [0.25, 0.5]]
  assert any('1 unreadable line' in n for n in run.status()['notes'])


def test_api_of_missing_and_good_runs(tmp_path):
  good = str(tmp_path / 'good')
  wd.write_workdir(good, 12)
  app = Dashboard([good, str(tmp_path / 'gone')], str(tmp_path)).app()
  client = TestClient(app)
  runs = client.get('/api/runs').json()['runs']
  assert [r['status'] for r in runs] == ['ok', 'missing']
  series = client.get('/api/series?keys=reward/*').json()['runs']
  assert series[0]['reward/mean'][0] == list(range(1, 13))
  assert series[1] == {}
  trace = client.get('/api/trace?run=0&step=12').json()
  rows = trace['rows']
  # 4 rows x 10 policy tokens, log π_old − log μ = 0.01·t, weights 1 but
  # one 2, staleness 0.
  summary = trace['summary']
  assert summary['staleness'] == {'0': 40}
  assert abs(summary['log_ratio']['p50'] - 0.05) < 1e-9
  assert summary['weight'] == {'p5': 1.0, 'p50': 1.0, 'p95': 1.0}
  assert [r['row'] for r in rows] == [0, 1, 2, 3]
  assert abs(rows[0]['mismatch_max'] - 0.09) < 1e-9  # t = 9: 0.01·t
  assert client.get('/api/traces?run=1').json() == {
    'steps': [],
    'eval_steps': [],
  }
  bad = client.get('/api/trace?run=5&step=1')
  assert bad.status_code == 400
  assert bad.json() == {'error': 'run=5: runs are 0..1'}
  assert client.get('/api/lab').json() == {'folders': []}
