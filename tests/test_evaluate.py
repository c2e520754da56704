"""`python -m jaxcorr.evaluate` on a real checkpoint of a tiny from-scratch
run (slow: a run, then the CLI in a fresh process), and its config loading
and errors (fast: no device work)."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxcorr import rewards
from jaxcorr.train.checkpoints import checkpointer
from jaxcorr.train.checkpoints import workdir as workdir_lib
from jaxcorr.train.evals import checkpoint, samples_log
from jaxcorr.train.loop import Trainer
from jaxcorr.train.tracker import metrics
from tests.helpers.trainer_config import pulse_config

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _saved_config(workdir, **overrides):
  """A workdir's config.json as the trainer writes it (no run)."""
  config = pulse_config(**overrides)
  workdir.mkdir(exist_ok=True)
  (workdir / workdir_lib.CONFIG_FILE).write_text(config.to_json())
  return config


def test_load_config_applies_eval_changes_only(tmp_path):
  _saved_config(tmp_path)
  config = checkpoint.load_config(
    str(tmp_path),
    ['eval.samples=8', 'eval.preset=liberal', 'train.eval_prompts=4'],
  )
  assert (config.eval.samples, config.eval.preset) == (8, 'liberal')
  assert config.train.eval_prompts == 4
  assert config.eval.samples_jsonl is True
  for bad, match in [
    ('optim.learning_rate=1', r'allowed: eval\.<field>=value or train\.'),
    ('eval.sampels=8', r'no field eval\.sampels; allowed: k, preset, samples,'),
    ('eval.samples_jsonl=yes', r"'yes' is not True or False"),
  ]:
    with pytest.raises(ValueError, match=match):
      checkpoint.load_config(str(tmp_path), [bad])


def test_a_workdir_saved_before_the_eval_section_loads(tmp_path):
  config = _saved_config(tmp_path)
  saved = json.loads(config.to_json())
  del saved['eval']
  (tmp_path / workdir_lib.CONFIG_FILE).write_text(json.dumps(saved))
  assert checkpoint.load_config(str(tmp_path), []).eval.samples == 0


def test_errors_without_a_run_or_a_checkpoint(tmp_path):
  with pytest.raises(ValueError, match=r'holds no config\.json'):
    checkpoint.load_config(str(tmp_path), [])


@pytest.mark.slow
def test_cli_evaluates_a_saved_checkpoint_as_the_loop_did(tmp_path):
  workdir = tmp_path / 'run'
  config = pulse_config(train__num_steps=2, train__eval_every=2)
  trainer = Trainer.from_config(config, str(workdir))
  trainer.train()
  trainer.close()
  logged = metrics.read_metrics(str(workdir))
  out = subprocess.run(
    [
      sys.executable,
      '-m',
      'jaxcorr.evaluate',
      f'--workdir={workdir}',
      '--step=2',
      '--set=eval.samples=4',
      '--set=eval.k=1,4',
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'step 2:' in out.stdout and 'eval/pass@4 = ' in out.stdout
  result = json.loads((workdir / 'evaluate' / 'step_2.json').read_text())
  # Restored exactly: the greedy numbers of the loop's step-2 evaluation.
  want = next(r for r in logged if r['step'] == 2)
  for key in ('eval/accuracy', 'eval/reward_mean', 'eval/response_length'):
    assert result[key] == want[key]
  assert 0 <= result['eval/pass@1'] <= result['eval/pass@4'] <= 1
  rows = samples_log.read(str(workdir / 'evaluate'), 2)
  loop_rows = samples_log.read(str(workdir / samples_log.DIRNAME), 2)
  greedy = [r for r in rows if r['mode'] == 'greedy']
  assert greedy == loop_rows
  assert sum(r['mode'] == 'sampled' for r in rows) == 4 * len(greedy)
  # Only the evaluate/ folder was written.
  assert not (workdir / 'evaluate' / 'metrics.jsonl').exists()
  bad = subprocess.run(
    [
      sys.executable,
      '-m',
      'jaxcorr.evaluate',
      f'--workdir={workdir}',
      '--step=1',
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert bad.returncode == 1
  assert 'error: --step=1: no such checkpoint; saved: [0, 2]' in bad.stderr


def _checkpoint_0(workdir, config_name: str = '') -> None:
  """A committed step 0 whose meta records `config_name` as the trainer's
  does (`plan` reads the meta alone; the state is a stand-in)."""
  with checkpointer.Checkpointer(
    str(workdir / workdir_lib.CHECKPOINT_DIR), every=1, keep=1
  ) as ckpt:
    ckpt.save(0, {'x': np.zeros(2, np.float32)}, {'config': config_name})


def test_output_dir_in_a_run_is_refused_and_non_empty_needs_force(tmp_path):
  """`--output_dir=<run>/eval_samples` used to replace the run's own eval
  samples (exit 0); now any directory in a run but the run's evaluate/
  is refused before anything is written, as export's --out is."""
  workdir = tmp_path / 'run'
  _saved_config(workdir)
  _checkpoint_0(workdir)
  samples = workdir / samples_log.DIRNAME
  samples.mkdir()
  (samples / 'step_0.jsonl').write_text('{"reply": "the run\'s"}\n')
  for out in (samples, workdir, workdir / 'new' / 'deeper'):
    with pytest.raises(ValueError, match=r'--output_dir=.* the run directory'):
      checkpoint.plan(str(workdir), output_dir=str(out), force=True)
  assert (samples / 'step_0.jsonl').read_text() == '{"reply": "the run\'s"}\n'
  other = tmp_path / 'other_run'
  _saved_config(other)
  _checkpoint_0(other)
  with pytest.raises(
    ValueError, match=r'is inside a run directory .*other_run'
  ):
    checkpoint.plan(str(workdir), output_dir=str(other / 'x'), force=True)
  busy = tmp_path / 'busy'
  busy.mkdir()
  (busy / 'notes.txt').write_text('mine')
  with pytest.raises(ValueError, match=r'non-empty directory.*--force'):
    checkpoint.plan(str(workdir), output_dir=str(busy))
  assert (
    checkpoint.plan(str(workdir), output_dir=str(busy), force=True).step == 0
  )
  # The run's own evaluate/ folder, the default, is evaluate's to write.
  (workdir / 'evaluate').mkdir()
  (workdir / 'evaluate' / 'step_0.json').write_text('{}')
  assert checkpoint.plan(str(workdir)).out == f'{workdir}/evaluate'


REGISTERED = 'test_registered_by_its_config'
CONFIG_SOURCE = f"""
import ml_collections

from jaxcorr import rewards

if {REGISTERED!r} not in rewards.REWARDS:
  rewards.register({REGISTERED!r})(lambda response, answer: 1.0)


def get_config(arg):  # called as main calls it; config.json is the config
  return ml_collections.ConfigDict({{'arg': arg}})
"""


def test_the_runs_config_file_registers_its_reward_first(tmp_path, monkeypatch):
  """A run whose reward its config file registers could not be evaluated
  (`not registered`): evaluate runs that file first, as main did."""
  monkeypatch.delitem(rewards.REWARDS, REGISTERED, raising=False)
  workdir = tmp_path / 'run'
  _saved_config(workdir, reward__functions=REGISTERED)
  gone = tmp_path / 'moved' / 'my_config.py'
  _checkpoint_0(workdir, f'{gone}:variant')
  with pytest.raises(ValueError, match=rf'{REGISTERED}.*{gone}.* not found'):
    checkpoint.plan(str(workdir))
  assert REGISTERED not in rewards.REWARDS
  shutil.rmtree(workdir / workdir_lib.CHECKPOINT_DIR)
  config_file = tmp_path / 'my_config.py'
  config_file.write_text(CONFIG_SOURCE)
  _checkpoint_0(workdir, f'{config_file}:variant')
  p = checkpoint.plan(str(workdir))
  assert REGISTERED in rewards.REWARDS
  assert REGISTERED in str(p.run.reward)
