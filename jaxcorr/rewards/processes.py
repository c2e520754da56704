"""Reward calls in worker processes that can be killed
(`config.reward.isolation='process'`).

A Python thread cannot be stopped, and a call that holds the GIL (a C
extension, a catastrophic `re` backtrack) stops every thread of the trainer
with it, its signal handlers included: SIGTERM is never acted on. A process
can be killed. `ProcessPool` runs each call in one of `max_workers` worker
processes; `abandon` SIGKILLs the worker of a call that ran past its time,
and a fresh worker takes its place before that slot's next call.

Workers are fresh interpreters (`sys.executable -c`, with the trainer's
`sys.path`), not forks, and not `multiprocessing`'s spawn either. The
trainer is multithreaded (JAX's and XLA's threads, the rollout producer)
and holds accelerator devices: a forked child inherits locks other threads
held at the fork and the device file descriptors, so it can deadlock, or
keep a TPU busy after the trainer is gone. `multiprocessing`'s spawn runs
the parent's main script again in each child, which starts a second
trainer from a script without an `if __name__ == '__main__'` guard. A fresh
worker imports the module that defines each reward function of the scorer,
which registers it again, and looks it up by name in `REWARDS`. A config
file outside any package is loaded from its path under the name
`ml_collections` gave it, so rewards registered at the top level of the
config module (or of any module it imports) are found. One registered any
other way (inside a function, a lambda added at run time, the main script)
does not exist in a fresh process: the pool's start fails naming it (use
`isolation='thread'` for it).

Costs: each worker start imports `jaxcorr.rewards` and those modules (about
1-2 s and 100-200 MB each), paid at start-up and again after each kill; a
call's arguments and value are pickled (microseconds for a response).
Workers ignore SIGINT and SIGTERM (a Ctrl-C or a scheduler's SIGTERM to the
process group is the trainer's to handle) and are killed with the trainer
(PR_SET_PDEATHSIG, Linux). Values come back as plain floats or bools; an
exception with its type and message, and the worker's traceback as its
`__cause__`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import importlib.util
import numbers
import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxcorr.rewards.registry import Outcome
from jaxcorr.rewards.workers import Task

# Seconds a new worker may take to import its modules and answer.
START_TIMEOUT_S = 120.0


class RemoteTraceback(Exception):
  """The traceback of an exception raised in a worker process."""

  def __str__(self) -> str:
    return self.args[0]


class NotAFloat:
  """Stands for a value a worker's reward returned that is not a number
  (its repr; the scorer reports it as not a finite float32)."""

  def __init__(self, text: str):
    self.text = text

  def __repr__(self) -> str:
    return self.text


def _plain(value: Any) -> Any:
  """A reward's value in a form that unpickles anywhere."""
  if isinstance(value, Outcome):
    return Outcome(_plain(value.value), str(value.reason)[:64])
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value.item()
  if isinstance(value, bool | np.bool_):
    return bool(value)
  if isinstance(value, numbers.Real):
    return float(value)
  return NotAFloat(repr(value)[:200])


def _portable(exc: BaseException) -> tuple[Any, str, str]:
  """(the exception if it pickles, else None; 'Type: message'; traceback)."""
  tb = ''.join(traceback.format_exception(type(exc), exc, exc.__traceback__))
  text = f'{type(exc).__name__}: {exc}'
  try:
    pickle.loads(pickle.dumps(exc))
  except Exception:
    return None, text, tb
  return exc, text, tb


def _die_with_parent() -> None:
  """SIGKILL this worker when the thread that started it ends (Linux)."""
  if not sys.platform.startswith('linux'):
    return
  import ctypes

  with contextlib.suppress(AttributeError, OSError):
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # SET_PDEATHSIG


def _load(modules: Sequence[tuple[str, str | None]]) -> None:
  """Imports each (module name, file) in this fresh process: by name, or
  from its file under the same name (a config file)."""
  for name, path in modules:
    if name in sys.modules:
      continue
    try:
      importlib.import_module(name)
      continue
    except ModuleNotFoundError as e:
      if e.name != name or path is None:
        raise
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def serve(inp, out_fd: int) -> None:
  """A worker's main (started by `_Worker`): load the modules, then answer
  (name, args) calls until EOF or None. `inp` is the pipe the bootstrap
  read sys.path from; results go to the pipe `out_fd`."""
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, signal.SIG_IGN)
  _die_with_parent()
  out = os.fdopen(out_fd, 'wb')

  def send(message: Any) -> None:
    pickle.dump(message, out, protocol=pickle.HIGHEST_PROTOCOL)
    out.flush()

  try:
    modules, names = pickle.load(inp)
    _load(modules)
    from jaxcorr.rewards.registry import REWARDS

    missing = [n for n in names if n not in REWARDS]
  except BaseException:
    send(('failed', traceback.format_exc()))
    return
  if missing:
    send(('missing', missing))
    return
  fns = {n: REWARDS[n] for n in names}
  send(('ready', None))
  while True:
    try:
      message = pickle.load(inp)
    except EOFError:
      return
    if message is None:
      return
    name, args = message
    try:
      reply = ('ok', _plain(fns[name](*args)))
    except BaseException as e:
      reply = ('error', _portable(e))
    send(reply)


def _modules(fns: dict[str, Callable]) -> list[tuple[str, str | None]]:
  """(module name, file) defining each function, in a stable order; the
  main script's are left out (a worker does not run it)."""
  out = {}
  for fn in fns.values():
    name = getattr(fn, '__module__', None)
    if name is None or name == '__main__':
      continue
    out[name] = getattr(sys.modules.get(name), '__file__', None)
  return sorted(out.items())


# The worker's first lines: the parent's sys.path before any import, so
# that jaxcorr and the reward modules resolve as they do in the trainer.
_BOOTSTRAP = (
  'import os, pickle, sys\n'
  "inp = os.fdopen(int(sys.argv[1]), 'rb')\n"
  'sys.path[:] = pickle.load(inp)\n'
  'from jaxcorr.rewards.processes import serve\n'
  'serve(inp, int(sys.argv[2]))\n'
)


class _Worker:
  """One worker process (a fresh interpreter, never the trainer's main
  script) and the parent's ends of its two pipes."""

  def __init__(self, modules, names):
    to_child, self._child_in = os.pipe()
    self._child_out, from_child = os.pipe()
    try:
      self.proc = subprocess.Popen(
        [sys.executable, '-c', _BOOTSTRAP, str(to_child), str(from_child)],
        stdin=subprocess.DEVNULL,
        pass_fds=(to_child, from_child),
      )
    finally:
      os.close(to_child)
      os.close(from_child)
    self._out = os.fdopen(self._child_in, 'wb')
    self._in = os.fdopen(self._child_out, 'rb')
    with contextlib.suppress(OSError):  # died at once: wait_ready says so
      self.send(list(sys.path))
      self.send((modules, names))

  def send(self, message: Any) -> None:
    pickle.dump(message, self._out, protocol=pickle.HIGHEST_PROTOCOL)
    self._out.flush()

  def recv(self) -> Any:
    """The next message; EOFError when the worker is gone."""
    try:
      return pickle.load(self._in)
    except (pickle.UnpicklingError, OSError) as e:
      raise EOFError(str(e)) from e

  def wait_ready(self, timeout: float) -> None:
    """Blocks until the worker has its functions; ValueError otherwise."""
    try:
      if not select.select([self._in], [], [], timeout)[0]:
        raise ValueError(
          f'a reward worker process did not start in {timeout} s'
        )
      kind, payload = self.recv()
    except EOFError:
      raise ValueError(
        'a reward worker process exited while starting (exit code '
        f'{self.kill()})'
      ) from None
    if kind == 'ready':
      return
    self.kill()
    if kind == 'missing':
      raise ValueError(
        "config.reward.isolation='process': reward(s) "
        f'{", ".join(map(repr, payload))} are not registered in a fresh '
        'process (registered inside a function, at run time, or in the main '
        'script?); register them at the top level of the config file or of '
        "a module it imports, or use isolation='thread'"
      )
    raise ValueError(
      "config.reward.isolation='process': a reward worker failed to import "
      f'the reward modules:\n{payload}'
    )

  def kill(self) -> int | None:
    """SIGKILL (if running) and reap; the exit code."""
    if self.proc.poll() is None:
      self.proc.kill()
    code = self.proc.wait()
    for f in (self._out, self._in):
      with contextlib.suppress(OSError):
        f.close()
    return code

  def stop(self) -> None:
    """Asks an idle worker to exit, then makes sure it did."""
    with contextlib.suppress(OSError):
      self.send(None)
    with contextlib.suppress(subprocess.TimeoutExpired):
      self.proc.wait(timeout=2)
    self.kill()


class ProcessPool:
  """`max_workers` worker processes, one feeding thread each, on one FIFO
  queue; the interface of `jaxcorr.rewards.workers.WorkerPool`.

  `abandon(task)` kills the process running it (the slot starts a fresh
  one for its next call), so nothing is ever left running: `stuck()` is 0.

  Args:
    max_workers: worker processes.
    fns: name -> reward function; each must be registered under that name
      when its module is imported in a fresh process (module doc).
  """

  def __init__(self, max_workers: int, fns: dict[str, Callable]):
    self._modules = _modules(fns)
    self._names = tuple(fns)
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._running: dict[Task, _Worker] = {}
    self._closed = False
    # Each slot thread starts its own workers: PR_SET_PDEATHSIG is tied to
    # the thread that started a process, and a slot lives as long as the
    # pool.
    ready = [concurrent.futures.Future() for _ in range(max_workers)]
    self._threads = [
      threading.Thread(
        target=self._slot, args=(r,), name='jaxcorr-reward-slot', daemon=True
      )
      for r in ready
    ]
    for t in self._threads:
      t.start()
    try:
      for r in ready:
        r.result()
    except BaseException:
      self.close()
      raise

  def _start_worker(self) -> _Worker:
    worker = _Worker(self._modules, self._names)
    worker.wait_ready(START_TIMEOUT_S)
    return worker

  def _slot(self, ready: concurrent.futures.Future) -> None:
    try:
      worker = self._start_worker()
    except BaseException as e:
      ready.set_exception(e)
      return
    ready.set_result(None)
    while True:
      task = self._queue.get()
      if task is None:
        break
      if not task.future.set_running_or_notify_cancel():
        continue
      if worker is None:
        try:
          worker = self._start_worker()
        except BaseException as e:
          task.future.set_exception(e)
          continue
      with self._lock:
        if task.abandoned or self._closed:
          continue  # given up on while the worker started
        self._running[task] = worker
      task.start = time.monotonic()
      try:
        worker.send((task.key, task.args))
        reply = worker.recv()
      except (EOFError, OSError):
        reply = None
      with self._lock:
        del self._running[task]
        abandoned = task.abandoned
      if abandoned or reply is None:
        # Killed by `abandon` (or dead by itself): start afresh next call.
        code = worker.kill()
        worker = None
        if not abandoned:
          task.future.set_exception(
            RuntimeError(
              f'the reward worker process died during the call (exit code '
              f'{code})'
            )
          )
        continue
      kind, payload = reply
      if kind == 'ok':
        task.future.set_result(payload)
      else:
        exc, text, tb = payload
        exc = exc if exc is not None else RuntimeError(text)
        exc.__cause__ = RemoteTraceback(tb)
        task.future.set_exception(exc)
    if worker is not None:
      worker.stop()

  def submit(self, key: str, fn: Callable, *args: Any) -> Task:
    """Queues `REWARDS[key](*args)` for a worker (`fn` is looked up by
    name there; it is `key`'s function here)."""
    task = Task(fn, args, key)
    self._queue.put(task)
    return task

  def abandon(self, task: Task) -> bool:
    """Gives up on `task`: a queued one is cancelled, a running one's
    worker killed. False if it finished."""
    if task.future.cancel():
      return True
    with self._lock:
      if task.future.done():
        return False
      task.abandoned = True
      worker = self._running.get(task)
      if worker is not None:
        worker.proc.kill()
      return True

  def stuck(self, key: str | None = None) -> int:
    """Always 0: an abandoned call's process is killed, not left running."""
    del key
    return 0

  def close(self) -> None:
    """Stops the workers; calls still running are killed."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      running = list(self._running.values())
    for _ in self._threads:
      self._queue.put(None)
    for worker in running:
      worker.proc.kill()
