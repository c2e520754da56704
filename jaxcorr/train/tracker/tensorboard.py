"""TensorBoard event files, written without TensorFlow.

`EventFile` appends TFRecord-framed `tensorflow.Event` protos (encoded here
by hand: neither TensorFlow nor the `tensorboard` package is a dependency,
and importing TensorFlow costs seconds) to one
`events.out.tfevents.<time>.<host>.<pid>` file per writer: one scalar
summary per metric, and a `SessionLog.START` event that TensorBoard reads as
a restart (`metrics.MetricWriter.truncate_after`).
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from collections.abc import Mapping
from typing import IO

import numpy as np

DIRECTORY = 'tensorboard'


def _crc32c_table() -> tuple[int, ...]:
  table = []
  for n in range(256):
    c = n
    for _ in range(8):
      c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    table.append(c)
  return tuple(table)


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli), as TFRecord framing uses."""
  c = 0xFFFFFFFF
  for b in data:
    c = _CRC_TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
  return c ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
  c = crc32c(data)
  return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _tfrecord(data: bytes) -> bytes:
  """One TFRecord: length, masked CRC of length, data, masked CRC of data."""
  length = struct.pack('<Q', len(data))
  return (
    length
    + struct.pack('<I', _masked_crc(length))
    + data
    + struct.pack('<I', _masked_crc(data))
  )


def _varint(n: int) -> bytes:
  n &= (1 << 64) - 1  # int64 two's complement, as protobuf does
  out = bytearray()
  while True:
    b = n & 0x7F
    n >>= 7
    if n:
      out.append(b | 0x80)
    else:
      out.append(b)
      return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
  if wire_type == 2:  # length-delimited
    payload = _varint(len(payload)) + payload
  return _varint(number << 3 | wire_type) + payload


_F32_MAX = float(np.finfo(np.float32).max)


def _float32(x: float) -> bytes:
  """Little-endian float32; values beyond its range become ±inf."""
  if abs(x) > _F32_MAX and math.isfinite(x):
    x = math.copysign(math.inf, x)
  return struct.pack('<f', x)


def _event(
  step: int,
  wall_time: float,
  *,
  file_version: str | None = None,
  scalars: Mapping[str, float] | None = None,
  session_start: bool = False,
) -> bytes:
  """A serialized `tensorflow.Event` (tensorflow/core/util/event.proto).

  Event: wall_time = 1 (double), step = 2 (int64), file_version = 3,
  summary = 5 (Summary: repeated Value value = 1; Value: tag = 1,
  simple_value = 2 (float)), session_log = 7 (SessionLog: status = 1,
  START = 1).
  """
  out = _field(1, 1, struct.pack('<d', wall_time)) + _field(2, 0, _varint(step))
  if file_version is not None:
    out += _field(3, 2, file_version.encode())
  if scalars is not None:
    values = b''.join(
      _field(
        1,
        2,
        _field(1, 2, tag.encode()) + _field(2, 5, _float32(value)),
      )
      for tag, value in scalars.items()
    )
    out += _field(5, 2, values)
  if session_start:
    out += _field(7, 2, _field(1, 0, _varint(1)))
  return out


class EventFile:
  """Append-only TensorBoard event file (one per writer instance)."""

  def __init__(self, directory: str):
    os.makedirs(directory, exist_ok=True)
    now = time.time()
    name = (
      f'events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}'
    )
    path, n = os.path.join(directory, name), 0
    while os.path.exists(path):  # a second writer within the same second
      n += 1
      path = os.path.join(directory, f'{name}.{n}')
    self.path = path
    self._f: IO[bytes] = open(self.path, 'ab')  # noqa: SIM115
    self._write(_event(0, now, file_version='brain.Event:2'))

  def _write(self, event: bytes) -> None:
    self._f.write(_tfrecord(event))
    self._f.flush()

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    if values:
      self._write(_event(step, time.time(), scalars=values))

  def session_start(self, step: int) -> None:
    self._write(_event(step, time.time(), session_start=True))

  def close(self) -> None:
    self._f.close()


class TensorBoardSink:
  """The `tensorboard` logger (`jaxcorr.train.tracker.sinks.Sink`): an
  `EventFile` under `<workdir>/tensorboard/`; a restart from checkpoint
  `step` writes `SessionLog.START` at `step + 1`, so TensorBoard discards
  the points the interrupted run logged from there on."""

  name = 'tensorboard'

  def __init__(self, workdir: str):
    self.events = EventFile(os.path.join(workdir, DIRECTORY))

  @property
  def path(self) -> str:
    return self.events.path

  def write(self, step: int, values: Mapping[str, float]) -> None:
    self.events.scalars(step, {k: float(v) for k, v in values.items()})

  def restart(self, step: int) -> None:
    self.events.session_start(step + 1)

  def close(self) -> None:
    self.events.close()
