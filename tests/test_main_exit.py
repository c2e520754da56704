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


def _main(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, '-m', 'jaxcorr.main', *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


@pytest.mark.parametrize(
  'case',
  [
    'misspelt_config',
    'workdir_is_a_file',
    'rollout_devices',
    'bad_field',
    'long_prompt',
  ],
)
def test_start_up_errors_are_one_line(tmp_path, case):
  afile = tmp_path / 'afile'
  afile.write_text('not a directory')
  rows = tmp_path / 'rows.jsonl'
  rows.write_text(
    '{"q": "1+2=", "a": "3"}\n{"q": "%s", "a": "3"}\n' % ('11+22=' * 5)
  )
  args, want = {
    'misspelt_config': (
      ['--config=configs/arith_tny.py', f'--workdir={tmp_path / "w"}'],
      'error: --config=configs/arith_tny.py: [Errno 2] No such file or '
      "directory: 'configs/arith_tny.py'",
    ),
    'workdir_is_a_file': (
      ['--config=configs/arith_tiny.py:pulse', f'--workdir={afile}'],
      f'error: --workdir={afile}: it is a file, not a directory',
    ),
    'rollout_devices': (
      [
        '--config=configs/arith_tiny.py:pulse',
        '--config.rollout.mode=async',
        '--config.rollout.max_staleness=1',
        '--config.rollout.rollout_devices=1000',
        f'--workdir={tmp_path / "w"}',
      ],
      'error: config.rollout.rollout_devices=1000: must leave the trainer '
      'at least one of the',
    ),
    # Was absl's usage text (the module docstring, every flag) first.
    'bad_field': (
      [
        '--config=configs/arith_tiny.py:pulse',
        '--config.train.mini_batches=7',
        f'--workdir={tmp_path / "w"}',
      ],
      'error: config.train.mini_batches: invalid value 7; allowed: a divisor',
    ),
    # Was a traceback after the model was built (packing or not).
    'long_prompt': (
      [
        '--config=configs/arith_tiny.py:pulse',
        '--config.data.source=jsonl',
        f'--config.data.path={rows}',
        '--config.data.prompt_field=q',
        '--config.data.answer_field=a',
        '--config.data.answer_format=raw',
        '--config.train.packing=True',
        f'--workdir={tmp_path / "w"}',
      ],
      'error: 1 prompt(s) cannot be used: 1 longer than '
      f"config.rollout.max_prompt_length=8: JSONL file '{rows}' line 2: 31 "
      'tokens; raise the limit or remove those rows.',
    ),
  }[case]
  proc = _main(*args)
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert 'Traceback' not in proc.stderr, proc.stderr[-3000:]
  assert 'flags:' not in proc.stderr, proc.stderr[-3000:]  # no usage text
  lines = proc.stderr.splitlines()
  assert lines[-1].startswith(want), proc.stderr[-3000:]
  assert sum(line.startswith('error') for line in lines) == 1


def test_rerunning_a_finished_run_says_nothing_to_do(tmp_path):
  args = (
    '--config=configs/arith_tiny.py:pulse',
    '--config.train.num_steps=1',
    '--config.train.eval_every=0',
    f'--workdir={tmp_path}',
  )
  first = _main(*args, timeout=600)
  assert first.returncode == 0 and 'done: ' in first.stdout, first.stderr[
    -3000:
  ]
  again = _main(*args)
  assert again.returncode == 0, again.stderr[-3000:]
  assert again.stdout.strip() == 'nothing to do: step 1 of 1'
