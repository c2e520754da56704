"""MetricWriter (metrics.jsonl + the TensorBoard sink), read_metrics, ProgressLine,
to_host_scalars."""

from __future__ import annotations

import io
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.train.tracker import metrics, step_rate, tensorboard
from tests.helpers.logger_records import event_class, tfrecords


def _lines(path) -> list[str]:
  with open(path, encoding='utf-8') as f:
    return f.read().splitlines()


def _strict_json(line: str):
  def reject(token):
    raise AssertionError(f'non-JSON constant {token} in {line}')

  return json.loads(line, parse_constant=reject)


# ------------------------------------------------------------------ JSONL


def test_jsonl_records_types_and_order(tmp_path):
  with metrics.MetricWriter(str(tmp_path)) as w:
    w.write(
      1,
      {
        'reward/mean': jnp.asarray(0.5, jnp.float32),
        'count': np.int64(7),
        'flag': jnp.asarray(True),
        'lr': 3e-4,
        'bf16': jnp.asarray(1.5, jnp.bfloat16),
      },
    )
    w.write(2, {'step': 2, 'reward/mean': 0.25})
  lines = _lines(tmp_path / 'metrics.jsonl')
  assert lines == [
    '{"step": 1, "reward/mean": 0.5, "count": 7, "flag": 1, "lr": 0.0003, '
    '"bf16": 1.5}',
    '{"step": 2, "reward/mean": 0.25}',
  ]
  first = _strict_json(lines[0])
  assert type(first['count']) is int and type(first['reward/mean']) is float
  assert metrics.read_metrics(str(tmp_path)) == [
    first,
    {'step': 2, 'reward/mean': 0.25},
  ]


def test_non_finite_values_are_null(tmp_path):
  with metrics.MetricWriter(str(tmp_path)) as w:
    w.write(
      3,
      {'a': float('nan'), 'b': np.inf, 'c': jnp.asarray(-jnp.inf), 'd': 1.0},
    )
  (line,) = _lines(tmp_path / 'metrics.jsonl')
  assert _strict_json(line) == {
    'step': 3,
    'a': None,
    'b': None,
    'c': None,
    'd': 1.0,
  }
  (record,) = metrics.read_metrics(str(tmp_path / 'metrics.jsonl'))
  assert all(np.isnan(record[k]) for k in 'abc') and record['d'] == 1.0


def test_appends_across_writers_and_drops_a_cut_line(tmp_path):
  with metrics.MetricWriter(str(tmp_path)) as w:
    w.write(1, {'a': 1.0})
  with open(tmp_path / 'metrics.jsonl', 'a') as f:
    f.write('{"step": 2, "a": 0.')  # killed mid-write
  assert [r['step'] for r in metrics.read_metrics(str(tmp_path))] == [1]
  with metrics.MetricWriter(str(tmp_path)) as w:
    w.write(2, {'a': 2.0})
  assert [r['step'] for r in metrics.read_metrics(str(tmp_path))] == [1, 2]
  assert _lines(tmp_path / 'metrics.jsonl')[-1] == '{"step": 2, "a": 2.0}'


def test_truncate_after_then_resume(tmp_path):
  w = metrics.MetricWriter(str(tmp_path))
  for s in range(1, 6):
    w.write(s, {'a': float(s)})
  w.truncate_after(3)
  assert [r['step'] for r in metrics.read_metrics(str(tmp_path))] == [1, 2, 3]
  # The writer keeps appending to the new file, not the replaced one.
  w.write(4, {'a': 40.0})
  w.close()
  got = metrics.read_metrics(str(tmp_path))
  assert [(r['step'], r['a']) for r in got] == [
    (1, 1.0),
    (2, 2.0),
    (3, 3.0),
    (4, 40.0),
  ]
  assert sorted(os.listdir(tmp_path)) == ['metrics.jsonl']  # no temp left


def test_disabled_writes_nothing(tmp_path):
  workdir = tmp_path / 'run'
  w = metrics.MetricWriter(str(workdir), enabled=False)
  w.write(1, {'a': jnp.ones(())})
  w.truncate_after(0)
  w.close()
  assert not workdir.exists()


def test_write_validates(tmp_path):
  with metrics.MetricWriter(str(tmp_path)) as w:
    with pytest.raises(ValueError, match=r"metric 'v' must be a scalar"):
      w.write(1, {'ok': 1.0, 'v': jnp.ones(3)})
    with pytest.raises(ValueError, match=r'metrics\["step"\]=2 differs'):
      w.write(1, {'step': 2})
    with pytest.raises(ValueError, match="metric 's' must be a real number"):
      w.write(1, {'s': 'text'})
  assert _lines(tmp_path / 'metrics.jsonl') == []
  with pytest.raises(ValueError, match='is closed'):
    w.write(2, {'a': 1.0})


# ------------------------------------------------------------ TensorBoard


def test_crc32c_reference_values():
  # RFC 3720 B.4 and the classic check value.
  assert tensorboard.crc32c(b'123456789') == 0xE3069283
  assert tensorboard.crc32c(bytes(32)) == 0x8A9136AA
  assert tensorboard.crc32c(b'\xff' * 32) == 0x62A8AB43


def _tb_writer(workdir) -> metrics.MetricWriter:
  return metrics.MetricWriter(
    str(workdir), sinks=[tensorboard.TensorBoardSink(str(workdir))]
  )


def _write_run(workdir):
  with _tb_writer(workdir) as w:
    w.write(1, {'reward/mean': 0.5, 'n': 3})
    w.write(2, {'reward/mean': jnp.asarray(0.75), 'n': 4})
    w.write(3, {'reward/mean': float('nan'), 'n': 5})
    w.truncate_after(2)
    w.write(3, {'reward/mean': 1.25, 'n': 6})
    return w.sinks[0].path


def test_tensorboard_float32_range_and_one_file_per_writer(tmp_path):
  with (
    _tb_writer(tmp_path) as a,
    _tb_writer(tmp_path) as b,
  ):
    a.write(1, {'big': 1e300, 'small': -1e300})
    b.write(1, {'x': 1.0})
    a_path = a.sinks[0].path
    assert a_path != b.sinks[0].path
  event_cls = event_class()
  (event,) = [
    e
    for e in map(event_cls.FromString, tfrecords(tmp_path / a_path))
    if e.HasField('summary')
  ]
  assert [v.simple_value for v in event.summary.value] == [np.inf, -np.inf]
  assert len(os.listdir(tmp_path / 'tensorboard')) == 2


def test_tensorboard_events_decode_with_protobuf(tmp_path):
  path = _write_run(tmp_path)
  assert os.path.dirname(path) == str(tmp_path / 'tensorboard')
  assert os.path.basename(path).startswith('events.out.tfevents.')
  event_cls = event_class()
  events = [event_cls.FromString(r) for r in tfrecords(tmp_path / path)]
  assert events[0].file_version == 'brain.Event:2'
  scalars = [
    (e.step, v.tag, v.simple_value)
    for e in events
    if e.HasField('summary')
    for v in e.summary.value
  ]
  assert scalars[:4] == [
    (1, 'reward/mean', 0.5),
    (1, 'n', 3.0),
    (2, 'reward/mean', 0.75),
    (2, 'n', 4.0),
  ]
  assert scalars[4][:2] == (3, 'reward/mean') and np.isnan(scalars[4][2])
  assert scalars[5:] == [(3, 'n', 5.0), (3, 'reward/mean', 1.25), (3, 'n', 6.0)]
  # truncate_after(2) marks a restart at step 3: TensorBoard drops the
  # orphaned step-3 points written before it.
  restarts = [e.step for e in events if e.HasField('session_log')]
  assert restarts == [3]
  assert [
    e.session_log.status for e in events if e.HasField('session_log')
  ] == [1]
  assert all(e.wall_time > 1e9 for e in events)


def test_tensorboard_events_read_by_tensorflow(tmp_path):
  """The same file through TensorFlow's own reader (when installed)."""
  import tensorflow as tf  # installed with google-jetstream

  path = _write_run(tmp_path)
  events = list(tf.compat.v1.train.summary_iterator(path))
  got = [
    (e.step, v.tag, v.simple_value)
    for e in events
    if e.HasField('summary')
    for v in e.summary.value
    if e.step != 3
  ]
  assert got == [
    (1, 'reward/mean', 0.5),
    (1, 'n', 3.0),
    (2, 'reward/mean', 0.75),
    (2, 'n', 4.0),
  ]
  starts = [e for e in events if e.HasField('session_log')]
  assert [(e.step, e.session_log.status) for e in starts] == [
    (3, tf.compat.v1.SessionLog.START)
  ]


# --------------------------------------------------------------- helpers


def test_to_host_scalars_one_transfer(monkeypatch):
  calls = []
  real = jax.device_get

  def counting(x):
    calls.append(x)
    return real(x)

  monkeypatch.setattr(jax, 'device_get', counting)
  out = metrics.to_host_scalars(
    {'a': jnp.asarray(1.5), 'b': jnp.asarray(2, jnp.int32), 'c': 0.25}
  )
  assert out == {'a': 1.5, 'b': 2, 'c': 0.25}
  assert [type(out[k]) for k in 'abc'] == [float, int, float]
  assert len(calls) == 1
  with pytest.raises(ValueError, match=r"metric 'x' must be a scalar.*\(2,\)"):
    metrics.to_host_scalars({'x': jnp.ones(2)})
  with pytest.raises(ValueError, match='metric keys must be str'):
    metrics.to_host_scalars({1: 1.0})


def test_progress_line_format_and_eta():
  out = io.StringIO()
  p = metrics.ProgressLine(100, keys=('reward/mean', 'kl'), stream=out)
  # The first step time is the compile step's: left out of the rate.
  line = p.update(11, {'reward/mean': jnp.asarray(0.5)}, 30.0)
  assert line == 'step 11/100 | reward/mean 0.5'
  line = p.update(12, {'reward/mean': jnp.asarray(0.531), 'x': 1}, 1.23)
  assert line == 'step 12/100 | reward/mean 0.531 | 1.23 s/step | ETA 1m48s'
  assert out.getvalue().splitlines()[-1] == line
  # The mean of the first 1/0.1 step times, then a moving average with
  # weight 0.1 on the newest.
  line = p.update(13, {'kl': 2.0}, 2.23)
  assert p.seconds_per_step == pytest.approx(1.73)
  assert line == 'step 13/100 | kl 2 | 1.73 s/step | ETA 2m31s'
  rate = step_rate.StepRate(compile_steps=0)
  for _ in range(10):
    rate.add(1.0)
  rate.add(2.0)
  assert rate.value == pytest.approx(1.1)
  assert metrics.format_duration(7 * 3600 + 5 * 60 + 20) == '7h05m'
  assert metrics.format_duration(42.4) == '42s'


def _make_run_step_times() -> tuple[np.ndarray, np.ndarray]:
  """(step times, compile time in each) shaped like `make run`'s 200 RL
  steps measured on 2 shared CPU cores: step 1 compiles the update and
  the engine (21.8 s, ~20 s compiling), step 2 the decode programs for the
  shorter responses of a trained model (6.0 s, ~5 s compiling, and the
  first runs of those programs: twice a step besides), step 3 a last one
  (0.2 s); a step takes ~0.5 s, with an evaluation every 20 steps and a
  checkpoint every 50 on top."""
  rng = np.random.default_rng(0)
  t = 0.5 * rng.uniform(0.75, 1.25, 200)
  compiled = np.zeros(200)
  compiled[:3] = 20.0, 5.0, 0.2
  t[:3] += compiled[:3] + np.array([1.0, 0.5, 0.0])
  t[19::20] += 0.15  # eval/accuracy on 256 held-out prompts
  t[49::50] += 0.3  # a checkpoint
  return t, compiled


def test_eta_leaves_compile_steps_and_compile_time_out():
  times, compiled = _make_run_step_times()
  n = len(times)

  def etas(rate, compile_time=True):
    out = []
    for step, (dt, c) in enumerate(zip(times, compiled), 1):
      rate.add(dt, c if compile_time else 0.0)
      out.append(rate.eta(n - step))
    return out

  got = etas(step_rate.StepRate())
  # Steps 1 and 2 compiled: no estimate yet (rather than a wrong one).
  assert got[:2] == [None, None]
  for step in range(3, n + 1):
    left = float(times[step:].sum())
    eta = got[step - 1]
    # Right within 1.5x from then on, or a few seconds near the end.
    assert left / 1.5 - 3 <= eta <= left * 1.5 + 3, (step, eta, left)
  # Averaging compile steps in (the old estimate, issue 23) is 10x off at
  # step 2: 55 minutes for 2 left; leaving step 1 out or taking the
  # compile time off step 2 is still 1.5-2x off.
  left = times[2:].sum()
  assert etas(step_rate.StepRate(compile_steps=0), False)[1] > 10 * left
  assert etas(step_rate.StepRate(), False)[1] > 5 * left
  residual = step_rate.StepRate()
  for dt, c in zip(times[:2], compiled[:2]):
    residual.add(dt - c)
  assert residual.eta(n - 2) > 1.5 * left


def test_compile_seconds_count_new_programs_in_any_thread():
  import threading

  before = step_rate.compile_seconds()
  f = jax.jit(lambda x: jnp.sin(x) * 3.0 + x.sum())
  thread = threading.Thread(target=lambda: f(jnp.ones(17)).block_until_ready())
  thread.start()
  thread.join()
  after = step_rate.compile_seconds()
  assert after > before
  f(jnp.ones(17)).block_until_ready()  # compiled already
  assert step_rate.compile_seconds() == after


def test_progress_line_every_and_last_step():
  out = io.StringIO()
  p = metrics.ProgressLine(7, keys=(), stream=out, every=3, compile_steps=0)
  printed = [s for s in range(1, 8) if p.update(s, {}, 1.0) is not None]
  assert printed == [3, 6, 7]
  assert out.getvalue().splitlines() == [
    'step 3/7 | 1 s/step | ETA 4s',
    'step 6/7 | 1 s/step | ETA 1s',
    'step 7/7 | 1 s/step | ETA 0s',
  ]
  assert metrics.ProgressLine(5, stream=out).update(1, {}) == 'step 1/5'
  quiet = io.StringIO()
  p = metrics.ProgressLine(5, stream=quiet, enabled=False, compile_steps=0)
  line = p.update(5, {}, 1)
  assert line == 'step 5/5 | 1 s/step | ETA 0s' and quiet.getvalue() == ''


def test_progress_line_default_stream_is_current_stderr(capsys):
  metrics.ProgressLine(2).update(1, {'reward/mean': 0.5}, 0.5)
  assert capsys.readouterr().err == 'step 1/2 | reward/mean 0.5\n'
