"""Daemon worker threads for reward calls, with abandon-and-replace.

A Python thread cannot be killed, so a call that runs past its time is
abandoned: it keeps its thread until it returns, and a fresh worker takes
its place at once, so later calls never queue behind a stuck one. The
threads are daemons because `concurrent.futures.ThreadPoolExecutor` joins
its (non-daemon) workers at interpreter exit, so one reward call that never
returns would hang the trainer's exit forever.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from typing import Any


class Task:
  """One submitted call: its future, and when a worker started it."""

  __slots__ = ('abandoned', 'args', 'fn', 'future', 'key', 'start')

  def __init__(self, fn: Callable, args: tuple, key: str):
    self.fn, self.args, self.key = fn, args, key
    self.future: concurrent.futures.Future = concurrent.futures.Future()
    self.start: float | None = None
    self.abandoned = False


class WorkerPool:
  """`max_workers` daemon threads on one FIFO queue.

  `abandon(task)` gives up on a running call and starts a replacement
  worker, so `max_workers` workers are always free of abandoned calls.
  `stuck(key)` counts the abandoned calls of one key (a reward name) that
  are still running: the scorer stops submitting calls for a key past its
  limit, which bounds the threads a reward that always hangs can hold.
  """

  def __init__(self, max_workers: int):
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._stuck: dict[str, int] = {}
    self._live = 0
    self._closed = False
    with self._lock:
      for _ in range(max_workers):
        self._spawn()

  def _spawn(self) -> None:
    self._live += 1
    threading.Thread(
      target=self._work, name='jaxcorr-reward', daemon=True
    ).start()

  def _work(self) -> None:
    while True:
      task = self._queue.get()
      if task is None:
        return
      if task.future.set_running_or_notify_cancel():
        task.start = time.monotonic()
        try:
          result = task.fn(*task.args)
        except BaseException as e:  # reported through the future
          task.future.set_exception(e)
        else:
          task.future.set_result(result)
        with self._lock:
          if task.abandoned:
            # A replacement took this worker's place when it was abandoned.
            self._stuck[task.key] -= 1
            return
      del task

  def submit(self, key: str, fn: Callable, *args: Any) -> Task:
    task = Task(fn, args, key)
    self._queue.put(task)
    return task

  def abandon(self, task: Task) -> bool:
    """Gives up on `task`: a queued one is cancelled, a running one left to
    its thread (replaced by a fresh worker). False if it finished."""
    if task.future.cancel():
      return True
    with self._lock:
      if task.future.done():
        return False
      task.abandoned = True
      self._stuck[task.key] = self._stuck.get(task.key, 0) + 1
      self._live -= 1
      if not self._closed:
        self._spawn()
      return True

  def stuck(self, key: str | None = None) -> int:
    """Abandoned calls still running (of `key`, or all)."""
    with self._lock:
      if key is None:
        return sum(self._stuck.values())
      return self._stuck.get(key, 0)

  def close(self) -> None:
    """Ends the idle workers (abandoned ones end when their call does)."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      for _ in range(self._live):
        self._queue.put(None)
