"""The loggers of `train.loggers`: TensorBoard, W&B (offline) and MLflow (a
local file store) record what metrics.jsonl records; the run config is
logged once; a logger that raises, opening or writing, is dropped with a
warning and training goes on; config errors name the field."""

from __future__ import annotations

import contextlib
import json
import math
import socket
import time
from collections.abc import Iterator

import pytest

from jaxcorr.train import build
from jaxcorr.train.loop import Trainer
from jaxcorr.train.tracker import background, metrics, sinks, wandb_sink
from jaxcorr.train.tracker.mlflow_sink import mlflow_name
from tests.helpers.logger_records import (
  mlflow_run,
  same_values,
  tensorboard_scalars,
  wandb_run,
)
from tests.helpers.trainer_config import pulse_config

CONFIG = {'train': {'seed': 3, 'loggers': 'tensorboard,wandb,mlflow'}}
STEPS = {
  0: {'eval/accuracy': 0.25, 'eval/pass@2': 0.5},
  1: {'reward/mean': 0.5, 'actor/pg_loss': -0.125, 'n': 3},
  2: {'reward/mean': float('nan'), 'actor/pg_loss': 1e-3, 'n': 4},
}


@pytest.fixture
def offline(tmp_path, monkeypatch):
  """W&B offline, no network, its settings kept inside tmp_path."""
  monkeypatch.setenv('WANDB_MODE', 'offline')
  monkeypatch.setenv('WANDB_SILENT', 'true')
  monkeypatch.setenv('WANDB_CONFIG_DIR', str(tmp_path / 'wandb-config'))
  monkeypatch.setenv('WANDB_CACHE_DIR', str(tmp_path / 'wandb-cache'))
  monkeypatch.setenv('WANDB_DATA_DIR', str(tmp_path / 'wandb-data'))
  monkeypatch.delenv('MLFLOW_TRACKING_URI', raising=False)
  return tmp_path


class Raising:
  """A logger whose backend fails on every write (a dead server)."""

  name = 'raising'

  def __init__(self):
    self.writes = 0

  def write(self, step, values):
    self.writes += 1
    raise ConnectionError('backend unreachable')

  def restart(self, step):
    pass

  def close(self):
    pass


def _ids(workdir) -> dict[str, str]:
  return json.loads((workdir / sinks.RUN_IDS).read_text())


def _uri(workdir) -> str:
  return f'file:{workdir / "mlruns"}'


def test_each_logger_records_what_metrics_jsonl_records(offline):
  workdir = offline / 'run'
  opened = sinks.open_sinks(
    'tensorboard,jsonl,wandb,mlflow', str(workdir), config=CONFIG
  )
  assert [s.name for s in opened] == ['tensorboard', 'wandb', 'mlflow']
  raising = Raising()
  with metrics.MetricWriter(str(workdir), sinks=[*opened, raising]) as w:
    tb_path = opened[0].path
    for step, values in STEPS.items():
      w.write(step, values)
    assert [s.name for s in w.sinks] == ['tensorboard', 'wandb', 'mlflow']
  assert raising.writes == 1  # dropped after its first failure

  jsonl = {r.pop('step'): r for r in metrics.read_metrics(str(workdir))}
  assert set(jsonl) == set(STEPS)
  for step, values in STEPS.items():
    assert same_values(jsonl[step], values)
  tb = tensorboard_scalars(tb_path)
  wb_config, wb = wandb_run(workdir)
  params, ml = mlflow_run(_uri(workdir), _ids(workdir)['mlflow'])
  for step, record in jsonl.items():
    assert same_values(tb[step], record, rel=1e-7), step  # float32
    assert same_values(wb[step], record), step
    (only,) = ml[step]
    assert same_values(only, {mlflow_name(k): v for k, v in record.items()})
  # The run config, once: W&B's run config, MLflow's params (flattened).
  assert wb_config == CONFIG
  assert params == {
    'train.seed': '3',
    'train.loggers': CONFIG['train']['loggers'],
  }
  assert mlflow_name('eval/pass@2') == 'eval/pass_at_2'


def test_resumed_workdir_logs_to_the_same_runs(offline):
  workdir = offline / 'run'
  spec = 'mlflow'
  with metrics.MetricWriter(
    str(workdir), sinks=sinks.open_sinks(spec, str(workdir), config=CONFIG)
  ) as w:
    w.write(1, {'reward/mean': 0.5})
    w.write(2, {'reward/mean': 0.25})
  first = _ids(workdir)['mlflow']
  changed = {'train': {'seed': 3, 'loggers': spec, 'num_steps': 9}}
  with metrics.MetricWriter(
    str(workdir), sinks=sinks.open_sinks(spec, str(workdir), config=changed)
  ) as w:
    w.truncate_after(1)
    w.write(2, {'reward/mean': 0.25})
    w.write(3, {'reward/mean': 0.75})
  assert _ids(workdir)['mlflow'] == first
  params, history = mlflow_run(_uri(workdir), first)
  assert 'train.num_steps' not in params  # params of the first start
  assert history[2] == [{'reward/mean': 0.25}, {'reward/mean': 0.25}]
  assert history[3] == [{'reward/mean': 0.75}]


def test_a_logger_that_fails_to_start_is_a_warning(offline, caplog):
  workdir = offline / 'run'
  with metrics.MetricWriter(
    str(workdir),
    sinks=sinks.open_sinks(
      'tensorboard,mlflow',
      str(workdir),
      config=CONFIG,
      mlflow_tracking_uri='nosuchscheme://nowhere',
    ),
  ) as w:
    w.write(1, {'reward/mean': 0.5})
  assert (
    'logger mlflow disabled: it failed to start (tracking URI '
    'nosuchscheme://nowhere)' in caplog.text
  )
  assert [r['step'] for r in metrics.read_metrics(str(workdir))] == [1]


@contextlib.contextmanager
def _dead_server(kind: str) -> Iterator[str]:
  """The URI of a loopback port that refuses connections (bound, not
  listening) or accepts them and never answers (listening, never read)."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    if kind == 'silent':
      s.listen(16)
    yield f'http://127.0.0.1:{s.getsockname()[1]}'


@pytest.mark.parametrize('kind', ['refusing', 'silent'])
def test_an_unreachable_tracking_server_does_not_delay_training(
  offline, caplog, kind
):
  """Training used to wait 4.5 minutes for a refusing server at start-up
  and over 10 for a silent one; now opening and writing take no time,
  closing at most `background.CLOSE_S`, and the warning names the URI."""
  workdir = offline / 'run'
  with _dead_server(kind) as uri:
    start = time.monotonic()
    opened = sinks.open_sinks(
      'mlflow', str(workdir), config=CONFIG, mlflow_tracking_uri=uri
    )
    with metrics.MetricWriter(str(workdir), sinks=opened) as w:
      for step, values in STEPS.items():
        w.write(step, values)
      assert time.monotonic() - start < 2.0
    assert time.monotonic() - start < background.CLOSE_S + 2.0
  assert 'logger mlflow' in caplog.text and uri in caplog.text
  assert [r['step'] for r in metrics.read_metrics(str(workdir))] == [0, 1, 2]


def test_training_goes_on_when_loggers_raise(offline, monkeypatch, caplog):
  """The real loggers, one that cannot start and one that raises on every
  write: the run completes and every logger that works has every step."""
  workdir = offline / 'run'
  real_open = sinks.open_sinks

  def with_raising(*args, **kwargs):
    return [*real_open(*args, **kwargs), Raising()]

  monkeypatch.setattr(sinks, 'open_sinks', with_raising)
  config = pulse_config(
    train__sft_steps=0,
    train__num_steps=1,
    train__eval_every=1,
    train__checkpoint_every=0,
    train__loggers='tensorboard,wandb,mlflow',
    train__mlflow_tracking_uri=f'file:{workdir / "mlruns"}',
  )
  trainer = Trainer.from_config(config, str(workdir), config_name='test')
  trainer.train()
  trainer.close()
  rows = metrics.read_metrics(str(workdir))
  assert [r['step'] for r in rows] == [0, 1]
  assert 'logger raising disabled' in caplog.text
  wb_config, wb = wandb_run(workdir)
  assert wb_config['train']['loggers'] == 'tensorboard,wandb,mlflow'
  _, ml = mlflow_run(_uri(workdir), _ids(workdir)['mlflow'])
  for r in rows:
    step = r.pop('step')
    assert same_values(wb[step], r), step
    assert same_values(ml[step][0], r), step
  assert math.isfinite(rows[-1]['eval/accuracy'])


@pytest.mark.parametrize(
  'value, why',
  [
    ('tensorbord', 'unknown: tensorbord'),
    ('wandb,wandb', 'a logger named twice'),
    (' , ', 'empty'),
  ],
)
def test_loggers_config_errors(value, why):
  config = pulse_config(train__loggers=value)
  with pytest.raises(ValueError, match=r'config\.train\.loggers') as e:
    build.build(config)
  assert why in str(e.value) and "'mlflow'" in str(e.value)


def test_loggers_are_stored_canonical():
  run = build.build(pulse_config(train__loggers=' wandb , jsonl'))
  assert run.train.loggers == 'wandb,jsonl'


def test_missing_package_names_the_extra():
  with pytest.raises(ValueError) as e:
    sinks.check_installed('tensorboard,mlflow', find=lambda module: None)
  assert 'config.train.loggers' in str(e.value)
  assert 'pip install "jaxcorr[mlflow]"' in str(e.value)
  sinks.check_installed('tensorboard,jsonl', find=lambda module: None)


def test_an_unreachable_wandb_server_delays_training_a_few_seconds(
  offline, monkeypatch, caplog
):
  """W&B online against a loopback socket that never answers used to hold
  the trainer for W&B's own start time-out (90 s); the run start is
  bounded by `wandb_sink.INIT_TIMEOUT_S` (here 2 s through
  WANDB_INIT_TIMEOUT), then the logger is dropped with a warning naming
  the server, and every step still reaches metrics.jsonl."""
  import wandb

  # Earlier tests' offline runs leave W&B's service process behind, with
  # their environment; a trainer process starts one service, online here.
  wandb.teardown()
  monkeypatch.delenv('WANDB_INIT_TIMEOUT', raising=False)
  assert wandb_sink.init_timeout() == wandb_sink.INIT_TIMEOUT_S <= 10
  workdir = offline / 'run'
  with _dead_server('silent') as uri:
    monkeypatch.setenv('WANDB_MODE', 'online')
    monkeypatch.setenv('WANDB_BASE_URL', uri)
    monkeypatch.setenv('WANDB_API_KEY', 'x' * 40)
    monkeypatch.setenv('WANDB_INIT_TIMEOUT', '2')
    start = time.monotonic()
    opened = sinks.open_sinks('wandb', str(workdir), config=CONFIG)
    assert time.monotonic() - start < 2.0 + 8.0  # + a loaded CI's start
    assert opened == []
    with metrics.MetricWriter(str(workdir), sinks=opened) as w:
      for step, values in STEPS.items():
        w.write(step, values)
  assert 'logger wandb disabled' in caplog.text
  assert f'server {uri}, init timeout 2 s' in caplog.text
  assert [r['step'] for r in metrics.read_metrics(str(workdir))] == [0, 1, 2]
