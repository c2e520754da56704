"""TensorFlow's start-up lines, kept off the console.

google-jetstream 0.2.2's `engine_api` imports its `token_utils`, which
imports seqio, which imports TensorFlow and tensorflow-text. JetStream has no
way to import its engine API without them (its main branch, read for this,
does the same),
and jaxcorr's engine subclasses `engine_api.Engine`, so every process that
generates loads TensorFlow once (docs/rollout.md, "TensorFlow at import").
jaxcorr runs nothing on TensorFlow: it is loaded for JetStream's default
SentencePiece tokenizer, which jaxcorr replaces.

Loading it prints absl-formatted lines from TensorFlow's C++ start-up (the
oneDNN notice, its CUDA probe: `cudart_stub.cc ... Could not find cuda
drivers`, and on a machine with a CUDA driver but no usable GPU `E0000 ...
failed call to cuInit`), which a new user reads as a failure. They are
written before absl logging is initialised, so `TF_CPP_MIN_LOG_LEVEL` does
not filter them in TensorFlow 2.21. `quiet_tensorflow_startup` wraps the
import: it captures the process's stderr (file descriptor 2) for its
duration and writes back every line except absl-formatted ones below
FATAL. `TF_CPP_MIN_LOG_LEVEL=0` keeps them all. Any other value drops them:
JAX sets the variable to 1 at import when it is unset, so 1 (or 2) cannot
tell a user's choice from JAX's default, and the CUDA probe's ERROR line is
exactly what a new user must not read as a failure. Nothing else that is
written to stderr meanwhile is lost.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

# absl's prefix: severity, MMDD, time, thread id, file:line]
_ABSL_LINE = re.compile(rb'^([IWEF])\d{4} [\d:.]+\s+\d+ [^\s\]]+:\d+\] ')
_ABSL_BANNER = (
  b'WARNING: All log messages before absl::InitializeLog() is called are '
  b'written to STDERR'
)
_SEVERITY = {b'I': 0, b'W': 1, b'E': 2, b'F': 3}


def min_log_level() -> int:
  """The level below which start-up lines are dropped: 0 when
  `TF_CPP_MIN_LOG_LEVEL` is 0 (keep all), else 3 (module docstring)."""
  return 0 if os.environ.get('TF_CPP_MIN_LOG_LEVEL', '').strip() == '0' else 3


def keep_line(line: bytes, level: int) -> bool:
  """Whether a captured stderr line is written back at `level`."""
  if level <= 0:
    return True
  if line.rstrip(b'\r\n') == _ABSL_BANNER:
    return False
  m = _ABSL_LINE.match(line)
  return m is None or _SEVERITY[m.group(1)] >= level


@contextlib.contextmanager
def quiet_tensorflow_startup() -> Iterator[None]:
  """Run the body (an import that loads TensorFlow) with its absl start-up
  lines filtered from stderr (module docstring)."""
  try:
    if sys.stderr is not None:
      sys.stderr.flush()
    saved = os.dup(2)
  except (OSError, ValueError):  # no usable stderr: nothing to filter
    yield
    return
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      yield
    finally:
      if sys.stderr is not None:
        sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      level = min_log_level()
      out = b''.join(
        line
        for line in captured.read().splitlines(True)
        if keep_line(line, level)
      )
      while out:
        out = out[os.write(2, out) :]
