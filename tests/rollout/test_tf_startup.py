"""Importing the engine prints nothing: TensorFlow, which JetStream's
`engine_api` loads, writes its C++ start-up lines (oneDNN, the CUDA probe,
`E0000 ... failed call to cuInit` on a machine with a driver but no GPU)
before absl logging is set up; `rollout.tf_startup` keeps them off the
console, shows every line with `TF_CPP_MIN_LOG_LEVEL=0`, and loses nothing else
written to stderr meanwhile."""

import os
import re
import subprocess
import sys

import pytest

from jaxcorr.rollout import tf_startup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABSL_LINE = re.compile(r'^[IWEF]\d{4} ', re.M)

# Lines as TensorFlow 2.21 writes them at import (the cuInit one from a
# machine with a CUDA driver and no usable GPU).
BANNER = (
  b'WARNING: All log messages before absl::InitializeLog() is called are '
  b'written to STDERR\n'
)
INFO = (
  b'I0000 00:00:1795687596.176745   10269 cudart_stub.cc:31] Could not find '
  b'cuda drivers on your machine, GPU will not be used.\n'
)
WARN = b'W0000 00:00:1795687596.177522   10269 cpu_feature_guard.cc:41] AVX\n'
ERROR = (
  b'E0000 00:00:1795687596.177522   10269 cuda_executor.cc:1228] failed '
  b'call to cuInit: INTERNAL: CUDA error: Failed call to cuInit: '
  b'UNKNOWN ERROR (303)\n'
)
OTHER = b'a warning of our own, not absl-formatted\n'


def test_importing_the_engine_prints_no_tensorflow_lines():
  env = {k: v for k, v in os.environ.items() if k != 'TF_CPP_MIN_LOG_LEVEL'}
  env['PYTHONPATH'] = os.pathsep.join(
    p for p in (ROOT, env.get('PYTHONPATH')) if p
  )
  # What the test guards against happens only if TensorFlow is loaded.
  code = (
    "import sys, jaxcorr.rollout.engine; print('tensorflow' in sys.modules)"
  )
  proc = subprocess.run(
    [sys.executable, '-c', code],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
    env=env,
  )
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out
  assert proc.stdout == 'True\n', 'TensorFlow no longer loads: drop this test'
  assert 'cuInit' not in out and 'E0000' not in out, out
  assert not ABSL_LINE.search(out), out
  assert 'absl::InitializeLog' not in out, out


def _through_filter(capfd, *lines: bytes) -> bytes:
  capfd.readouterr()
  with tf_startup.quiet_tensorflow_startup():
    for line in lines:
      os.write(2, line)
  return capfd.readouterr().err.encode()


def test_only_absl_lines_below_the_level_are_dropped(capfd, monkeypatch):
  lines = (BANNER, INFO, OTHER, WARN, ERROR)
  monkeypatch.delenv('TF_CPP_MIN_LOG_LEVEL', raising=False)
  assert _through_filter(capfd, *lines) == OTHER
  # JAX sets 1 at import when the variable is unset: not a user's choice.
  for level in ('1', '2', '3'):
    monkeypatch.setenv('TF_CPP_MIN_LOG_LEVEL', level)
    assert _through_filter(capfd, *lines) == OTHER
  monkeypatch.setenv('TF_CPP_MIN_LOG_LEVEL', '0')
  assert _through_filter(capfd, *lines) == b''.join(lines)


def test_stderr_is_restored_after_an_error_in_the_body(capfd, monkeypatch):
  monkeypatch.delenv('TF_CPP_MIN_LOG_LEVEL', raising=False)
  capfd.readouterr()
  with pytest.raises(ImportError), tf_startup.quiet_tensorflow_startup():
    os.write(2, OTHER + ERROR)
    raise ImportError('no such module')
  os.write(2, b'after\n')
  assert capfd.readouterr().err.encode() == OTHER + b'after\n'
