"""What the command lines print on the console.

The progress lines (`metrics.ProgressLine`, with the ETA), jaxcorr's own
log lines and every library's warnings and errors; not the libraries' INFO
logs (orbax alone writes a few lines per checkpoint), which
`--verbose_libs` turns back on. The files a run writes are not affected.

A record is jaxcorr's own when the call that logged it is in a file of this
package: absl (which orbax logs through) records the caller's file, so the
rule needs no list of library loggers.

`dropped_library_errors(text)` silences the libraries' records of one error
while jaxcorr reports it in one line itself (a checkpoint save on a full
disk: orbax logs the traceback from each of its writer threads before the
save raises).
"""

from __future__ import annotations

import contextlib
import logging as py_logging
import os
from collections.abc import Iterator

from absl import flags, logging

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep

VERBOSE_LIBS = flags.DEFINE_bool(
  'verbose_libs',
  False,
  "Also print the libraries' INFO logs (orbax, JAX, ...) on the console; by "
  "default only their warnings and errors, with jaxcorr's own logs and "
  'progress lines.',
)


class OwnInfoOnly(py_logging.Filter):
  """Passes warnings and errors, and lower levels only from jaxcorr."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    if record.levelno >= py_logging.WARNING:
      return True
    return _own(record)


def quiet_libraries(verbose: bool | None = None) -> None:
  """Filter the console handler (absl's, which every logger reaches)
  unless `verbose` (default: `--verbose_libs`). Idempotent."""
  if verbose is None:
    verbose = VERBOSE_LIBS.value
  handler = logging.get_absl_handler()
  mine = [f for f in handler.filters if isinstance(f, OwnInfoOnly)]
  if verbose:
    for f in mine:
      handler.removeFilter(f)
  elif not mine:
    handler.addFilter(OwnInfoOnly())


def _own(record: py_logging.LogRecord) -> bool:
  return os.path.abspath(record.pathname).startswith(_PACKAGE)


class _DropLibraryText(py_logging.Filter):
  def __init__(self, text: str):
    super().__init__()
    self.text = text

  def filter(self, record: py_logging.LogRecord) -> bool:
    return _own(record) or self.text not in record.getMessage()


@contextlib.contextmanager
def dropped_library_errors(text: str) -> Iterator[None]:
  """Inside the block, drop the libraries' log records whose message holds
  `text` (jaxcorr's own records pass)."""
  f = _DropLibraryText(text)
  # The absl logger (orbax logs through it) and the handler (what other
  # loggers reach on the console).
  targets = (logging.get_absl_logger(), logging.get_absl_handler())
  for t in targets:
    t.addFilter(f)
  try:
    yield
  finally:
    for t in targets:
      t.removeFilter(f)
