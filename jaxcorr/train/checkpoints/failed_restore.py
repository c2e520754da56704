"""What a failed Orbax restore leaves behind, discarded quietly.

Orbax reads a checkpoint's arrays as asyncio tasks on TensorStore futures
and stops at the first error: the other reads, failed or still in flight,
are never awaited. When Python frees them (at the next garbage collection,
or at exit), asyncio logs each one, "Task exception was never retrieved"
with its whole TensorStore spec, and TensorStore's callbacks into the closed
event loop print "Event loop is closed" tracebacks. A damaged step's
one-line `CheckpointRestoreError` ended up under hundreds of lines of traces
for a tiny model, thousands for a real one.

`install()`, called before each restore, drops only those leftovers:
asyncio's never-retrieved records whose exception came from Orbax or
TensorStore, never-awaited-coroutine warnings, and unraisable exceptions of
Orbax coroutines or of a call into a closed event loop; everything else is
reported as before. `discard_leftovers(error)`, called where the restore
error is caught, frees what it can at once (the finished frames of the
error's traceback hold the tasks).
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import traceback
import warnings
from typing import Any

_UNRETRIEVED = 'exception was never retrieved'
_ORBAX = '/orbax/'
_lock = threading.Lock()
_installed = False


def _from_orbax(exc: BaseException | None) -> bool:
  """Whether `exc` was raised by Orbax or TensorStore."""
  if exc is None:
    return False
  if 'tensorstore_spec' in str(exc):
    return True
  tb = exc.__traceback__
  while tb is not None:
    if _ORBAX in tb.tb_frame.f_code.co_filename:
      return True
    tb = tb.tb_next
  return False


class _DropLeftovers(logging.Filter):
  """asyncio's never-retrieved records of Orbax's reads."""

  def filter(self, record: logging.LogRecord) -> bool:
    if _UNRETRIEVED not in str(record.msg):
      return True
    exc = record.exc_info[1] if record.exc_info else None
    return not _from_orbax(exc)


def _leftover(unraisable: Any) -> bool:
  """An unraisable exception of an Orbax coroutine (finalized at exit), or
  of a TensorStore callback into the event loop Orbax closed."""
  code = getattr(unraisable.object, 'cr_code', None)
  if code is not None and _ORBAX in code.co_filename:
    return True
  exc = unraisable.exc_value
  return isinstance(exc, RuntimeError) and str(exc) == 'Event loop is closed'


def install() -> None:
  """Drops the leftovers from now on (module doc); idempotent. Called
  before each restore: some TensorStore callbacks fire while Orbax is still
  unwinding the failed one."""
  global _installed
  with _lock:
    if _installed:
      return
    _installed = True
  logging.getLogger('asyncio').addFilter(_DropLeftovers())
  warnings.filterwarnings(
    'ignore',
    message=r"coroutine '.*' was never awaited",
    category=RuntimeWarning,
  )
  previous = sys.unraisablehook

  def hook(unraisable: Any) -> None:
    if not _leftover(unraisable):
      previous(unraisable)

  sys.unraisablehook = hook


def _chain(error: BaseException | None):
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    yield error
    error = error.__cause__ or error.__context__


def discard_leftovers(error: BaseException) -> None:
  """Called in the `except` block that caught a failed restore (module
  doc), before the one-line error is raised or logged."""
  install()
  for e in _chain(error):
    if e.__traceback__ is not None:
      traceback.clear_frames(e.__traceback__)
  gc.collect()
