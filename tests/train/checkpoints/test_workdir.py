"""Workdir claims: a second trainer is refused (two processes), a changed
config is refused before anything is written, config.json is atomic."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from jaxcorr.train.checkpoints import workdir as workdir_lib
from jaxcorr.train.loop import Trainer
from tests.helpers.trainer_config import pulse_config


def _saved_run(path, config) -> str:
  """A workdir as a finished run leaves it: config.json + a step dir."""
  claim = workdir_lib.claim(str(path), config)
  claim.write_config()
  claim.release()
  (path / 'checkpoints' / '10').mkdir(parents=True)
  return (path / 'config.json').read_text()


def test_second_process_is_refused_while_the_first_holds_the_lock(tmp_path):
  holder = subprocess.Popen(
    [
      sys.executable,
      '-c',
      textwrap.dedent(f"""
        import sys
        from configs import arith_tiny
        from jaxcorr.train.checkpoints import workdir
        claim = workdir.claim({str(tmp_path)!r}, arith_tiny.get_config())
        print('claimed', flush=True)
        sys.stdin.readline()
      """),
    ],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert holder.stdout.readline().strip() == 'claimed'
    with pytest.raises(workdir_lib.WorkdirBusy, match=f'pid {holder.pid}'):
      workdir_lib.claim(str(tmp_path), pulse_config())
  finally:
    holder.stdin.close()
    holder.wait(timeout=60)
  # The lock went with its holder: the directory can be claimed again.
  workdir_lib.claim(str(tmp_path), pulse_config()).release()


def test_lock_is_released_by_release_and_taken_again(tmp_path):
  claim = workdir_lib.claim(str(tmp_path), pulse_config())
  with pytest.raises(workdir_lib.WorkdirBusy):
    workdir_lib.claim(str(tmp_path), pulse_config())
  claim.release()
  claim.release()  # idempotent
  workdir_lib.claim(str(tmp_path), pulse_config()).release()


def test_changed_learning_rate_is_refused_before_anything_is_written(
  tmp_path,
):
  saved = _saved_run(tmp_path, pulse_config())
  before = sorted(p.name for p in tmp_path.iterdir())
  changed = pulse_config(optim__learning_rate=2e-3)
  with pytest.raises(
    workdir_lib.ConfigChanged, match=r'config.optim.learning_rate: .*--allow'
  ):
    Trainer.from_config(changed, str(tmp_path))
  assert (tmp_path / 'config.json').read_text() == saved
  assert sorted(p.name for p in tmp_path.iterdir()) == before
  # The refusal released the lock, and the flag lets it continue.
  workdir_lib.claim(str(tmp_path), changed, allow_change=True).release()


def test_changed_preset_is_refused_and_resumable_fields_are_not(tmp_path):
  _saved_run(tmp_path, pulse_config())
  other = pulse_config('bypass_pg_geo_rs')
  with pytest.raises(
    workdir_lib.ConfigChanged, match=r'config\.correction\.mode'
  ):
    workdir_lib.claim(str(tmp_path), other)
  longer = pulse_config()
  longer.train.num_steps = 1000
  longer.train.eval_every = 7
  workdir_lib.claim(str(tmp_path), longer).release()


def test_config_json_is_checked_only_when_checkpoints_exist(tmp_path):
  claim = workdir_lib.claim(str(tmp_path), pulse_config())
  claim.write_config()
  claim.release()
  # No committed step: a fresh start may use any config.
  claim = workdir_lib.claim(
    str(tmp_path), pulse_config(optim__learning_rate=0.5)
  )
  claim.write_config()
  claim.release()
  saved = json.loads((tmp_path / 'config.json').read_text())
  assert saved['optim']['learning_rate'] == 0.5
  assert not (tmp_path / 'config.json.tmp').exists()


def test_config_changes_lists_added_and_removed_fields():
  changes = workdir_lib.config_changes(
    {'a': {'x': 1, 'y': 2}, 'train': {'num_steps': 5}},
    {'a': {'x': 1, 'z': 3}, 'train': {'num_steps': 9}},
  )
  assert changes == [('a.y', 2, '(absent)'), ('a.z', '(absent)', 3)]


def test_a_run_saved_before_a_new_section_resumes_at_its_defaults():
  """A workdir saved before a section existed (here `lora`) resumes
  without --allow_config_change while the section stays at its defaults;
  turning the new feature on is a change."""
  new = json.loads(pulse_config().to_json())
  saved = {k: v for k, v in new.items() if k != 'lora'}
  assert workdir_lib.config_changes(saved, new) == []
  new['lora']['rank'] = 8
  assert workdir_lib.config_changes(saved, new) == [
    ('lora.rank', '(absent)', 8)
  ]


def test_a_run_saved_under_a_renamed_field_resumes(tmp_path):
  """`rollout.engine_quant` is `rollout.simulated_quant` now: a run saved
  with the old name reads under the new one (claim, checkpoint meta)."""
  new = json.loads(pulse_config(rollout__simulated_quant='int8').to_json())
  saved = json.loads(json.dumps(new))
  saved['rollout']['engine_quant'] = saved['rollout'].pop('simulated_quant')
  assert workdir_lib.config_changes(saved, new) == []
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  got = workdir_lib.read_config(str(tmp_path))
  assert got['rollout']['simulated_quant'] == 'int8'
  assert 'engine_quant' not in got['rollout']


def test_config_json_cut_short_is_an_error_naming_it(tmp_path):
  saved = _saved_run(tmp_path, pulse_config())
  (tmp_path / 'config.json').write_text(saved[: len(saved) // 2])
  with pytest.raises(workdir_lib.ConfigUnreadable) as e:
    workdir_lib.claim(str(tmp_path), pulse_config())
  assert str(tmp_path / 'config.json') in str(e.value)
  assert 'not valid JSON' in str(e.value) and '\n' not in str(e.value)
  # The refusal released the lock.
  (tmp_path / 'config.json').write_text(saved)
  workdir_lib.claim(str(tmp_path), pulse_config()).release()


def test_without_config_json_the_checkpoint_refuses_a_changed_config(
  tmp_path,
):
  """Every checkpoint holds the run's config: deleting config.json does not
  let a changed learning rate resume silently; --allow_config_change
  still does."""
  config = pulse_config()
  config.train.num_steps = 1
  config.train.eval_every = 0
  Trainer.from_config(config, str(tmp_path)).train()
  (tmp_path / 'config.json').unlink()
  metrics = (tmp_path / 'metrics.jsonl').read_text()
  changed = config.copy_and_resolve_references()
  changed.optim.learning_rate = 2e-3
  with pytest.raises(
    workdir_lib.ConfigChanged,
    match=r'config.optim.learning_rate: .*from checkpoint step 1.*--allow',
  ):
    Trainer.from_config(changed, str(tmp_path)).train()
  assert (tmp_path / 'metrics.jsonl').read_text() == metrics
  assert not (tmp_path / 'config.json').exists()
  changed.train.num_steps = 2
  trainer = Trainer.from_config(
    changed, str(tmp_path), allow_config_change=True
  )
  trainer.train()
  assert trainer.step == 2
  saved = json.loads((tmp_path / 'config.json').read_text())
  assert saved['optim']['learning_rate'] == 2e-3
