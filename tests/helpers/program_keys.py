"""Which programs a block of code compiled, by their persistent-cache key.

JAX's persistent compile cache logs, per compile request, the key of the
program (a hash of its HLO, compile options and devices): "Persistent
compilation cache hit for '<module>' with key '<key>'", or "... MISS ...".
Two requests with one key are one compile: the second loads the first's
executable. The trainer always runs with a cache (tests/conftest.py's, or
`train.compile_cache`'s default, <workdir>/compile_cache), so its compile
requests are always logged here.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

_CACHE_LOGGER = 'jax._src.compiler'


class _Keys(logging.Handler):
  def __init__(self, module: str):
    super().__init__(logging.DEBUG)
    self.module, self.keys = module, []

  def emit(self, record: logging.LogRecord) -> None:
    if record.msg.lower().startswith('persistent compilation cache'):
      module, key = record.args
      if module == self.module:
        self.keys.append(key)


@contextlib.contextmanager
def program_keys(module: str) -> Iterator[list[str]]:
  """The keys of the programs compiled (or loaded) for `module` (e.g.
  'jit__prepare' for a `jax.jit` of `_prepare`) inside the block, one per
  compile request, in order."""
  logger = logging.getLogger(_CACHE_LOGGER)
  handler, level = _Keys(module), logger.level
  logger.addHandler(handler)
  logger.setLevel(logging.DEBUG)
  try:
    yield handler.keys
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)
