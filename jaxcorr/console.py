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

`run(main)` is `app.run(main)` for every entry point, with command-line
errors as one line, `error: ...` (exit status 1): absl prints its usage
text (the module docstring and every flag, 40 lines) before the message of
an `app.UsageError`, a flag that does not parse gets two lines, and a
config flag (ml_collections) raises a traceback for an override of a field
the config does not have (`--config.train.num_step=5`) or a config file
that fails (an unknown preset), or defers a missing file to its first use.
`--help` still prints the usage. A config flag with a default file is
defined by `config_file_flag`: ml_collections loads a default file, with
the command line's overrides, when the flag is *defined* (at import, out
of any parser's reach), so the default is given to the parser instead.
"""

from __future__ import annotations

import contextlib
import functools
import logging as py_logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from absl import app, flags, logging
from ml_collections import config_flags

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


_FILE_DEFAULTS: dict[int, str] = {}  # id(flag) -> its default config file


def config_file_flag(
  name: str,
  default: str | None,
  help_string: str,
  flag_values: flags.FlagValues = flags.FLAGS,
) -> flags.FlagHolder:
  """A locked `--<name>=file[:config string]` config flag whose `default`
  file is loaded when `parse_flags` runs (module doc), not at import."""
  holder = config_flags.DEFINE_config_file(
    name,
    None,
    f'{help_string} (default: {default})' if default else help_string,
    flag_values=flag_values,
    lock_config=True,
  )
  if default:
    _FILE_DEFAULTS[id(flag_values[name])] = default
  return holder


def run(main: Callable[[list[str]], Any]) -> None:
  """`app.run(main)` with one-line command-line errors (module doc)."""
  app.run(functools.partial(_usage_in_one_line, main), flags_parser=parse_flags)


def _usage_in_one_line(main: Callable[[list[str]], Any], argv: list[str]):
  try:
    return main(argv)
  except app.UsageError as e:
    sys.exit(f'error: {e}')


def parse_flags(
  argv: Sequence[str], flag_values: flags.FlagValues = flags.FLAGS
) -> list[str]:
  """`flag_values(argv)`, exiting with one line, `error: ...`, when a flag
  does not parse, a config override names no field of the config, or a
  config file cannot be loaded; the arguments left for `main`."""
  argv = list(argv)
  for name in list(flag_values):
    default = _FILE_DEFAULTS.get(id(flag_values[name]))
    given = [
      a for a in argv[1:] if a.partition('=')[0] in (f'-{name}', f'--{name}')
    ]
    if default and not given:
      argv.insert(1, f'--{name}={default}')
  try:
    rest = flag_values(argv)
  except flags.Error as e:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    # A failing config file: its traceback's last line is the error.
    sys.exit(f'error: {" ".join(lines[:1] + lines[1:][-1:])}')
  except (AttributeError, KeyError) as e:
    sys.exit(f'error: {_missing_field(e, argv)}')
  for name in list(flag_values):
    _check_loaded(name, flag_values[name], argv)
  return rest


def _missing_field(error: BaseException, argv: Sequence[str]) -> str:
  """ml_collections' KeyError for `--config.a.b=v` naming no field, e.g.
  `'num_step'\nDid you mean "num_steps" instead of "num_step"?`, as
  `--config.train.num_step=5: the config has no field 'num_step' (Did you
  mean ...)`.
  Re-raised when no override names the key (a config file's own bug)."""
  inner: Any = error
  while inner.args and isinstance(inner.args[0], BaseException):
    inner = inner.args[0]
  text = str(inner.args[0]) if inner.args else ''
  key, _, hint = text.partition('\n')
  key = key.strip('\'"')
  for arg in argv:
    path = arg.lstrip('-').partition('=')[0].split('.')
    if arg.startswith('--') and len(path) > 1 and key in path[1:]:
      more = f' ({hint.strip()})' if hint.strip() else ''
      return f'{arg}: the config has no field {key!r}{more}'
  raise error


def _check_loaded(name: str, flag: Any, argv: Sequence[str]) -> None:
  """A config file that could not be read fails on its first use (a
  misspelt path): now, in one line."""
  try:
    filename = config_flags.get_config_filename(flag)
  except TypeError:  # not a config flag
    return
  try:
    getattr(flag.value, 'keys', None)  # a failed load raises on any access
  except OSError as e:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    why = lines[-1].rpartition('earlier failure to load: ')[2]
    given = [a for a in argv if a.startswith(f'--{name}=')]
    arg = given[-1] if given else f'--{name}={filename}'
    sys.exit(f'error: {arg}: {why}')
