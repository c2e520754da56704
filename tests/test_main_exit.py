"""`python -m jaxcorr.main` stopped by SIGTERM or Ctrl-C (SIGINT): it
checkpoints the step it was on and exits with `EXIT_PREEMPTED` (75), so a
scheduler tells a preempted run from a finished one (0) and a crash (1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from jaxcorr.train import preemption

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _first_rl_step(workdir, proc, timeout=600.0) -> None:
  path = os.path.join(workdir, 'metrics.jsonl')
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    assert proc.poll() is None, proc.communicate()
    if os.path.exists(path):
      with open(path) as f:
        if any(json.loads(line)['step'] >= 1 for line in f if line.strip()):
          return
    time.sleep(0.2)
  raise TimeoutError('no RL step logged')


@pytest.mark.slow
@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGINT])
def test_signal_checkpoints_and_exits_75(tmp_path, sig):
  workdir = str(tmp_path / 'run')
  proc = subprocess.Popen(
    [
      sys.executable,
      '-m',
      'jaxcorr.main',
      '--config=configs/arith_tiny.py:pulse',
      '--config.train.num_steps=1000',
      '--config.train.eval_every=0',
      '--config.train.checkpoint_every=0',
      f'--workdir={workdir}',
    ],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  try:
    _first_rl_step(workdir, proc)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=300)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == preemption.EXIT_PREEMPTED, out[-3000:]
  assert 'preempted: checkpoint at step' in out
  assert 'done:' not in out
  steps = [
    int(p)
    for p in os.listdir(os.path.join(workdir, 'checkpoints'))
    if p.isdigit()
  ]
  # Step 0 (after SFT) and the step the signal arrived in.
  assert len(steps) == 2 and max(steps) >= 1, steps
