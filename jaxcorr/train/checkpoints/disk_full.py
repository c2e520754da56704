"""A checkpoint save on a full disk, in one line.

The storage layer's own report is hundreds of lines: TensorStore raises a
ValueError ("... No space left on device [os_error_code='28']") from each
of orbax's writer threads, which orbax logs with its traceback before the
save raises it again. `jaxcorr.train.checkpoints.resume.RunCheckpoints`
turns it into `DiskFull`, naming the directory and its free space, and
drops those log records (`jaxcorr.console.dropped_library_errors`);
`jaxcorr.main` prints it as one `error:` line.
"""

from __future__ import annotations

import errno
import os
import shutil

# How the storage layer words ENOSPC (module doc); Python's OSError has errno.
NO_SPACE = os.strerror(errno.ENOSPC)


class DiskFull(OSError):
  """A checkpoint that could not be written for lack of space (one line)."""


def no_space(e: BaseException | None) -> bool:
  """Whether `e` or an exception it was raised from is ENOSPC."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
      return True
    if NO_SPACE in str(e):
      return True
    e = e.__cause__ or e.__context__
  return False


def free_space(path: str) -> str:
  """'1.2 GiB free' on the file system of `path` (or its nearest existing
  parent); 'free space unknown' for object stores."""
  if '://' in path:
    return 'free space unknown'
  path = os.path.abspath(path)
  while not os.path.exists(path):
    path = os.path.dirname(path)
  free = float(shutil.disk_usage(path).free)
  for unit in ('B', 'KiB', 'MiB', 'GiB'):
    if free < 1024 or unit == 'GiB':
      break
    free /= 1024
  return f'{free:.3g} {unit} free'
