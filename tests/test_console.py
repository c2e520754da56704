"""The console filter: libraries' INFO logs off, jaxcorr's and every
warning kept, `--verbose_libs` (verbose=True) turns them back on."""

from __future__ import annotations

import logging as py_logging
import os

from absl import logging

import jaxcorr
from jaxcorr import console


def _record(path: str, level: int) -> py_logging.LogRecord:
  return py_logging.LogRecord('absl', level, path, 1, 'msg', (), None)


def test_library_info_dropped_own_info_and_warnings_kept():
  f = console.OwnInfoOnly()
  own = os.path.join(os.path.dirname(jaxcorr.__file__), 'train', 'loop.py')
  lib = '/site-packages/orbax/checkpoint/checkpointer.py'
  assert f.filter(_record(own, py_logging.INFO))
  assert not f.filter(_record(lib, py_logging.INFO))
  assert not f.filter(_record(lib, py_logging.DEBUG))
  assert f.filter(_record(lib, py_logging.WARNING))
  assert f.filter(_record(lib, py_logging.ERROR))
  # A sibling directory whose name starts like the package's is not it.
  assert not f.filter(_record(own.replace('jaxcorr', 'jaxcorr_x'), 20))


def test_quiet_libraries_installs_once_and_verbose_removes():
  handler = logging.get_absl_handler()

  def mine():
    return [f for f in handler.filters if isinstance(f, console.OwnInfoOnly)]

  try:
    console.quiet_libraries(verbose=False)
    console.quiet_libraries(verbose=False)
    assert len(mine()) == 1
    console.quiet_libraries(verbose=True)
    assert mine() == []
  finally:
    for f in mine():
      handler.removeFilter(f)
