"""The sandbox contains hostile code: each case ends with its reason, the
host sees no side effect, and nothing it started outlives the run. The
cases run concurrently (a few seconds in all)."""

from __future__ import annotations

import concurrent.futures
import os
import secrets
import socket
import time

import pytest

from jaxcorr.sandbox import runner
from jaxcorr.sandbox.runner import Limits, run_python

FAST = Limits(timeout_s=2.0, cpu_s=2, max_output=4096)


def _alive(token: str) -> list[int]:
  """Processes whose command line holds `token`."""
  found = []
  for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
      with open(f'/proc/{pid}/cmdline', 'rb') as f:
        if token.encode() in f.read():
          found.append(int(pid))
    except OSError:
      pass
  return found


def _run(code: str, **kw):
  token = secrets.token_hex(6)  # in every sandboxed process's argv
  start = time.monotonic()
  result = run_python({'main.py': code}, 'main.py', FAST, argv=[token], **kw)
  return result, time.monotonic() - start, token


@pytest.fixture(scope='module')
def listener():
  """A loopback server on the host the sandbox must not reach."""
  server = socket.socket()
  server.bind(('127.0.0.1', 0))
  server.listen()
  server.setblocking(False)
  yield server
  server.close()


def _hostile(port: int, secret: str) -> dict[str, str]:
  probe = (
    'import os, socket\n'
    'for host in ("127.0.0.1", "192.0.2.1"):\n'  # 192.0.2.1: TEST-NET-1
    '  s = socket.socket(); s.settimeout(5)\n'
    '  try:\n'
    f'    s.connect((host, {port} if host[0] == "1" and host[1] == "2" '
    'else 80)); print("connected", host)\n'
    '  except OSError as e: print("refused", host, e.errno)\n'
  )
  reads = (
    'import os\n'
    f'for p in ({secret!r}, {os.getcwd()!r}, {__file__!r}, "/root/.cache", '
    '"/proc/1/environ", "/etc/passwd"):\n'
    '  try:\n'
    '    print("read", p, os.listdir(p) if os.path.isdir(p) else '
    'open(p).read()[:20])\n'
    '  except OSError as e: print("hidden", p)\n'
  )
  writes = (
    'import os\n'
    'for p in ("/tmp/x", "/etc/x", "/usr/x", "/x", "/dev/x"):\n'
    '  try: open(p, "w").write("x"); print("wrote", p)\n'
    '  except OSError: print("refused", p)\n'
    'open("/scratch/ok", "w").write("x"); print("scratch ok")\n'
  )
  return {
    'fork_bomb': 'import os\nwhile True:\n  try: os.fork()\n  except OSError: pass',
    'infinite_loop': 'while True: pass',
    'allocation': 'x = bytearray(10 * 1024 ** 3)',
    'huge_output': 'while True: print("x" * 1000)',
    'escape_group': (
      'import os, time\nif os.fork() == 0:\n  os.setsid()\ntime.sleep(60)'
    ),
    'file_size': 'open("big", "wb").write(b"x" * (64 << 20))',
    'socket': probe,
    'reads': reads,
    'writes': writes,
  }


def test_hostile_code_is_contained(listener, tmp_path):
  secret = tmp_path / 'trainer_secret'
  secret.write_text('do not read')
  cases = _hostile(listener.getsockname()[1], str(secret))
  with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
    runs = dict(zip(cases, pool.map(_run, cases.values())))
  status = {name: r.status for name, (r, _, _) in runs.items()}
  assert status == {
    'fork_bomb': runner.TIMEOUT,
    'infinite_loop': runner.TIMEOUT,
    'allocation': runner.MEMORY,
    'huge_output': runner.OUTPUT,
    'escape_group': runner.TIMEOUT,
    'file_size': runner.ERROR,
    'socket': runner.OK,
    'reads': runner.OK,
    'writes': runner.OK,
  }, {n: (r.status, r.detail, r.stderr[-300:]) for n, (r, _, _) in runs.items()}
  for name, (result, seconds, token) in runs.items():
    print(name, result.status, f'{seconds:.2f} s')
    assert seconds < FAST.timeout_s + 3, name
    assert not _alive(token), f'{name}: processes outlived the run'
  assert len(runs['huge_output'][0].stdout) == FAST.max_output
  assert 'File too large' in runs['file_size'][0].detail
  net = runs['socket'][0].stdout.split('\n')
  assert net[:2] == ['refused 127.0.0.1 101', 'refused 192.0.2.1 101'], net
  with pytest.raises(BlockingIOError):
    listener.accept()
  reads = runs['reads'][0].stdout
  assert 'read' not in reads.replace('read /etc/passwd', ''), reads
  assert 'hidden /etc/passwd' in reads  # no /etc beyond ld.so.cache
  writes = runs['writes'][0].stdout
  assert 'wrote' not in writes and 'scratch ok' in writes, writes
  assert not os.path.exists('/x') and not os.path.exists('/usr/x')


def test_a_plain_program_runs_with_its_files():
  result = run_python(
    {'main.py': 'import data\nprint(data.X * 2)', 'data.py': 'X = 21'},
    'main.py',
  )
  assert (result.status, result.stdout, result.returncode) == ('ok', '42\n', 0)
  runner.check_available()


def test_bad_limits_and_file_names_name_the_field():
  with pytest.raises(ValueError, match=r'Limits.memory_mb: invalid value 1'):
    Limits(memory_mb=1)
  with pytest.raises(ValueError, match='a flat name'):
    run_python({'../x.py': ''}, 'x.py')
