"""A logger that talks to a server from a thread of its own: training never
waits on the network.

A tracking server that refuses connections, or accepts them and never
answers, used to hold the trainer at start-up for as long as the client's
retries lasted (MLflow's: 4.5 minutes refused, over 10 minutes silent).
`Background` opens the sink (connect, create the run, log the config) and
sends every write on one daemon thread, in order; the trainer's `write`
and `restart` only queue, so opening and writing cost it microseconds
whatever the server does.

A sink that fails to open, or raises on a write, is logged once as a
warning naming its `where` (the tracking URI or directory) and dropped;
later writes are discarded, as `MetricWriter` drops a sink that raises.
At most `MAX_PENDING` writes wait (a server slower than the steps): past
that the newest are discarded, with one warning. `close` waits for the
queue to drain while the sink makes progress (a slow but live server gets
every point), and gives up once it has made none for `CLOSE_S` seconds
(a dead one): the thread is left behind with a warning counting what was
not sent (a daemon thread: the process exits without it).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from absl import logging

from jaxcorr import console

CLOSE_S = 5.0
MAX_PENDING = 10_000
_CLOSE = object()


def _one_line(e: BaseException) -> str:
  """`Type: first line of the message` (clients' errors span pages)."""
  text = str(e).strip().splitlines()
  return f'{type(e).__name__}: {text[0][:300] if text else ""}'.rstrip(': ')


class Background:
  """A `sinks.Sink` whose sink `opener()` opens and writes on a thread
  (module doc); `where` names its server or directory in warnings."""

  def __init__(self, name: str, where: str, opener: Callable[[], Any]):
    self.name = name
    self.where = where
    self._opener = opener
    self._queue: queue.Queue = queue.Queue(MAX_PENDING)
    self._failed = threading.Event()
    self._full_warned = False
    self._progress = time.monotonic()  # the worker's last step done
    self._thread = threading.Thread(
      target=self._run, name=f'logger-{name}', daemon=True
    )
    self._thread.start()

  def _warn(self, what: str, e: BaseException) -> None:
    self._failed.set()
    logging.warning(
      'logger %s disabled: %s (%s): %s', self.name, what, self.where,
      _one_line(e),
    )  # fmt: skip

  def _run(self) -> None:
    # urllib3 (under MLflow's client) logs every retry; the one warning
    # that matters is this logger's own.
    with console.dropped_library_errors('Retrying (Retry('):
      self._serve()

  def _serve(self) -> None:
    try:
      sink = self._opener()
    except Exception as e:  # a logger never stops a run
      self._warn('it failed to start', e)
      sink = None
    self._progress = time.monotonic()
    while True:
      item = self._queue.get()
      if item is _CLOSE:
        break
      if self._failed.is_set():
        continue  # dropped: discard what is queued
      method, args = item
      try:
        getattr(sink, method)(*args)
      except Exception as e:
        self._warn(f'{method} failed', e)
      self._progress = time.monotonic()
    if sink is not None:
      try:
        sink.close()
      except Exception as e:
        self._warn('close failed', e)

  def _put(self, item: Any) -> None:
    if self._failed.is_set():
      return
    try:
      self._queue.put_nowait(item)
    except queue.Full:
      if not self._full_warned:
        self._full_warned = True
        logging.warning(
          'logger %s: %d writes wait for %s; discarding new ones until it '
          'catches up',
          self.name,
          MAX_PENDING,
          self.where,
        )

  def write(self, step: int, values: Mapping[str, float]) -> None:
    self._put(('write', (step, dict(values))))

  def restart(self, step: int) -> None:
    self._put(('restart', (step,)))

  def close(self) -> None:
    start = time.monotonic()
    queued = 0  # the close marker, once queued
    # The marker waits for room: the worker drains the queue.
    with contextlib.suppress(queue.Full):
      self._queue.put(_CLOSE, timeout=CLOSE_S)
      queued = 1
    while self._thread.is_alive():
      self._thread.join(0.05)
      if time.monotonic() - max(self._progress, start) > CLOSE_S:
        break
    if self._thread.is_alive():
      logging.warning(
        'logger %s: %s made no progress for %.0f s (%d writes not sent); '
        'left behind',
        self.name,
        self.where,
        CLOSE_S,
        max(self._queue.qsize() - queued, 0),
      )
