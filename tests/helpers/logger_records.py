"""Readers of what each logger wrote, for tests that compare them:
TensorBoard event files (decoded by protobuf from a descriptor, not by the
writer's own encoder), a W&B offline run's `.wandb` transaction log, and
an MLflow store through MLflow's public client."""

from __future__ import annotations

import glob
import json
import math
import os
import pathlib
import struct
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from jaxcorr.train.tracker import tensorboard


def event_class():
  """`tensorflow.Event` (the fields used) built from a descriptor, so the
  file is decoded by protobuf itself, not by the writer's own encoder."""
  f = descriptor_pb2.FileDescriptorProto(
    name='test_event.proto', package='tbtest', syntax='proto3'
  )
  T = descriptor_pb2.FieldDescriptorProto
  value = f.message_type.add(name='Value')
  value.field.add(name='tag', number=1, type=T.TYPE_STRING)
  value.field.add(name='simple_value', number=2, type=T.TYPE_FLOAT)
  summary = f.message_type.add(name='Summary')
  summary.field.add(
    name='value',
    number=1,
    type=T.TYPE_MESSAGE,
    type_name='.tbtest.Value',
    label=T.LABEL_REPEATED,
  )
  session_log = f.message_type.add(name='SessionLog')
  session_log.field.add(name='status', number=1, type=T.TYPE_INT32)
  event = f.message_type.add(name='Event')
  event.field.add(name='wall_time', number=1, type=T.TYPE_DOUBLE)
  event.field.add(name='step', number=2, type=T.TYPE_INT64)
  event.field.add(name='file_version', number=3, type=T.TYPE_STRING)
  event.field.add(
    name='summary', number=5, type=T.TYPE_MESSAGE, type_name='.tbtest.Summary'
  )
  event.field.add(
    name='session_log',
    number=7,
    type=T.TYPE_MESSAGE,
    type_name='.tbtest.SessionLog',
  )
  pool = descriptor_pool.DescriptorPool()
  pool.Add(f)
  return message_factory.GetMessageClass(
    pool.FindMessageTypeByName('tbtest.Event')
  )


def tfrecords(path) -> list[bytes]:
  """TFRecord payloads, checking both masked CRCs of every record."""

  def masked(data):
    c = tensorboard.crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF

  data = pathlib.Path(path).read_bytes()
  out, i = [], 0
  while i < len(data):
    header = data[i : i + 8]
    (n,) = struct.unpack('<Q', header)
    assert struct.unpack('<I', data[i + 8 : i + 12])[0] == masked(header)
    payload = data[i + 12 : i + 12 + n]
    crc = struct.unpack('<I', data[i + 12 + n : i + 16 + n])[0]
    assert crc == masked(payload)
    out.append(payload)
    i += 16 + n
  assert i == len(data)
  return out


def tensorboard_scalars(path) -> dict[int, dict[str, float]]:
  """`{step: {tag: value}}` of an event file (one segment, no restarts)."""
  out: dict[int, dict[str, float]] = {}
  cls = event_class()
  for record in tfrecords(path):
    event = cls.FromString(record)
    for v in event.summary.value:
      out.setdefault(event.step, {})[v.tag] = v.simple_value
  return out


_WANDB_BLOCK = 32768


def _wandb_records(path: str) -> list[bytes]:
  """The records of a `.wandb` file: a 7-byte header (`:W&B`, magic,
  version), then LevelDB-log framing: 32 KiB blocks of chunks, each a
  7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
  with open(path, 'rb') as f:
    data = f.read()
  assert data[:4] == b':W&B', path
  out, pos, parts = [], 7, b''
  while pos + 7 <= len(data):
    left = _WANDB_BLOCK - pos % _WANDB_BLOCK
    if left < 7:  # a block's zero-padded tail
      pos += left
      continue
    _, n, kind = struct.unpack('<IHB', data[pos : pos + 7])
    if kind == 0:
      pos += left
      continue
    chunk = data[pos + 7 : pos + 7 + n]
    pos += 7 + n
    if kind == 1:
      out.append(chunk)
    elif kind == 2:
      parts = chunk
    elif kind == 3:
      parts += chunk
    elif kind == 4:
      out.append(parts + chunk)
  return out


def wandb_run(workdir) -> tuple[dict[str, Any], dict[int, dict[str, float]]]:
  """(config, `{step: {name: value}}`) of the offline W&B run(s) under
  `<workdir>/wandb/`, read from their transaction logs with W&B's own
  protobuf messages."""
  from wandb.proto import wandb_internal_pb2 as pb

  config: dict[str, Any] = {}
  history: dict[int, dict[str, float]] = {}
  paths = sorted(
    glob.glob(os.path.join(workdir, 'wandb', '*-run-*', '*.wandb'))
  )
  assert paths, f'no W&B run under {workdir}'
  for path in paths:
    for data in _wandb_records(path):
      record = pb.Record()
      record.ParseFromString(data)
      kind = record.WhichOneof('record_type')
      if kind == 'run':
        for item in record.run.config.update:
          config[item.key] = json.loads(item.value_json)
      elif kind == 'history':
        items = {
          i.key or '/'.join(i.nested_key): json.loads(i.value_json)
          for i in record.history.item
        }
        step = items.pop('_step')
        values = {k: v for k, v in items.items() if not k.startswith('_')}
        history.setdefault(step, {}).update(values)
  config.pop('_wandb', None)
  return config, history


def mlflow_run(
  uri: str, run_id: str
) -> tuple[dict[str, str], dict[int, list[dict[str, float]]]]:
  """(params, `{step: [{name: value}, ...]}`) of an MLflow run through the
  public client; a step logged twice (a resumed run) has two dicts."""
  os.environ.setdefault('MLFLOW_ALLOW_FILE_STORE', 'true')
  from mlflow.tracking import MlflowClient

  client = MlflowClient(tracking_uri=uri)
  run = client.get_run(run_id)
  points: dict[int, list[tuple[int, str, float]]] = {}
  for key in run.data.metrics:
    for m in client.get_metric_history(run_id, key):
      points.setdefault(m.step, []).append((m.timestamp, key, m.value))
  history: dict[int, list[dict[str, float]]] = {}
  for step, pts in sorted(points.items()):
    per: dict[str, list[float]] = {}
    for _, key, value in sorted(pts, key=lambda p: p[0]):
      per.setdefault(key, []).append(value)
    n = max(len(v) for v in per.values())
    history[step] = [
      {k: v[i] for k, v in per.items() if i < len(v)} for i in range(n)
    ]
  return dict(run.data.params), history


def same_values(a: dict[str, float], b: dict[str, float], rel=1e-6) -> bool:
  """Equal keys and values (NaN equals NaN; `rel` for float32 copies)."""
  if set(a) != set(b):
    return False
  for k in a:
    x, y = float(a[k]), float(b[k])
    if math.isnan(x) or math.isnan(y):
      if not (math.isnan(x) and math.isnan(y)):
        return False
    elif not math.isclose(x, y, rel_tol=rel, abs_tol=1e-30):
      return False
  return True
