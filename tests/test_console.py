"""The console filter: libraries' INFO logs off, jaxcorr's and every
warning kept, `--verbose_libs` (verbose=True) turns them back on; the
command lines' flag errors in one line (`console.parse_flags`)."""

from __future__ import annotations

import logging as py_logging
import os
import sys

import pytest
from absl import flags, logging

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


# ------------------------------------------------------ one-line errors

TINY = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'configs')
TINY = os.path.join(TINY, 'arith_tiny.py')


def _parse(monkeypatch, *args):
  """A command line parsed as the entry points parse theirs: a config
  flag with a default file (`console.config_file_flag`), then
  `console.parse_flags` (ml_collections reads overrides from sys.argv)."""
  argv = ['prog', *args]
  monkeypatch.setattr(sys, 'argv', argv)
  fv = flags.FlagValues()
  holder = console.config_file_flag('config', TINY, 'A config.', fv)
  flags.DEFINE_string('workdir', None, 'A directory.', flag_values=fv)
  console.parse_flags(argv, fv)
  return holder.value


def _error(monkeypatch, *args) -> str:
  with pytest.raises(SystemExit) as info:
    _parse(monkeypatch, *args)
  return str(info.value.code)


def test_the_default_file_loads_at_parse_with_its_overrides(monkeypatch):
  config = _parse(monkeypatch, '--config.train.num_steps=7')
  assert config.train.num_steps == 7 and config.data.source == 'arithmetic'
  config = _parse(monkeypatch, f'--config={TINY}:pulse')
  assert config.train.sft_steps == 2


@pytest.mark.parametrize(
  'args, want',
  [
    # Was a traceback (a KeyError raised while the flag was defined).
    (
      ['--config.train.num_step=3'],
      "error: --config.train.num_step=3: the config has no field 'num_step' "
      '(Did you mean "num_steps" instead of "num_step"?)',
    ),
    (
      ['--config.trian.num_steps=3'],
      "error: --config.trian.num_steps=3: the config has no field 'trian' "
      '(Did you mean "train" instead of "trian"?)',
    ),
    # Was a traceback of the config file inside absl's two-line message.
    (
      [f'--config={TINY}:nope'],
      f'error: flag --config={TINY}:nope: Error whilst parsing config '
      "file: ValueError: unknown preset 'nope'.",
    ),
    (
      ['--config=configs/arith_tny.py'],
      'error: --config=configs/arith_tny.py: [Errno 2] No such file or '
      "directory: 'configs/arith_tny.py'",
    ),
    (
      ['--config.train.num_steps=x'],
      'error: flag --config.train.num_steps=x: invalid literal for int()',
    ),
    (['--worklir=/tmp'], "error: Unknown command line flag 'worklir'"),
  ],
)
def test_flag_errors_are_one_line(monkeypatch, args, want):
  message = _error(monkeypatch, *args)
  assert message.startswith(want), message
  assert '\n' not in message
