"""The configs that show features on the embedded tiny model, no
downloads: configs/rg_tiny.py (a reasoning-gym task over the byte
vocabulary) and configs/env_tiny.py (an environment registered in the
config module). Each is loaded as `jaxcorr.main` loads it (a config-file
flag) and runs 2 RL steps end to end."""

from __future__ import annotations

import json
import pathlib

import pytest
from absl import flags
from ml_collections import config_flags

from jaxcorr.train.loop import Trainer

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / 'configs'


def _load(name: str):
  """`--config=configs/<name>.py:pulse` through a config flag (the file
  runs as a module of its own, as under `jaxcorr.main`)."""
  argv = ['prog', f'--config={CONFIGS / name}.py:pulse']
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file('config', flag_values=fv, sys_argv=argv)
  fv(argv)
  return fv.config


def _two_rl_steps(config, workdir, **sizes) -> list[dict]:
  """2 RL steps, no warm-up, eval or checkpoint; one layer (compiles are
  most of the time), `sizes` as `section__field=value`."""
  with config.unlocked():
    config.model.num_layers = 1
    for path, value in sizes.items():
      section, field = path.split('__')
      config[section][field] = value
    config.train.num_steps = 2
    config.train.sft_steps = 0
    config.train.eval_every = 0
    config.train.checkpoint_every = 0
  Trainer.from_config(config, str(workdir), config_name='test').train()
  with open(workdir / 'metrics.jsonl') as f:
    return [r for r in map(json.loads, f) if r['step'] > 0]


def test_reasoning_gym_runs_on_the_tiny_model(tmp_path):
  pytest.importorskip('reasoning_gym')
  config = _load('rg_tiny')
  assert config.data.tokenizer == 'bytes'
  rows = _two_rl_steps(config, tmp_path, rollout__max_new_tokens=8)
  assert [r['step'] for r in rows] == [1, 2]
  assert all(0.0 <= r['reward/mean'] <= 1.0 for r in rows)


def test_a_config_registered_environment_runs_on_the_tiny_model(tmp_path):
  config = _load('env_tiny')
  _load('env_tiny')  # loaded twice in one process: registered once
  rows = _two_rl_steps(
    config, tmp_path, rollout__max_new_tokens=40, agent__max_turns=2
  )
  assert [r['step'] for r in rows] == [1, 2]
  for r in rows:
    # Several turns, and the environment's words came back as bytes.
    assert r['agent/turns_mean'] > 1 and r['agent/env_tokens_mean'] > 0
    assert r['agent/env_errors'] == 0
