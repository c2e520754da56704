"""What the command lines print on the console.

The progress lines (`metrics.ProgressLine`, with the ETA), jaxcorr's own
log lines and every library's warnings and errors; not the libraries' INFO
logs (orbax alone writes a few lines per checkpoint), which
`--verbose_libs` turns back on. The files a run writes are not affected.

A record is jaxcorr's own when the call that logged it is in a file of this
package: absl (which orbax logs through) records the caller's file, so the
rule needs no list of library loggers.
"""

from __future__ import annotations

import logging as py_logging
import os

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
    return os.path.abspath(record.pathname).startswith(_PACKAGE)


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
