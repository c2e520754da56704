"""The `eval` section: presets, the k's, set names, and the start-up
errors that name the field and the allowed values."""

from __future__ import annotations

import json

import pytest

from jaxcorr.train import build
from jaxcorr.train.checkpoints import workdir as workdir_lib
from jaxcorr.train.evals.config import PRESETS, EvalConfig, Preset
from jaxcorr.train.rollouts.config import RolloutConfig
from tests.helpers.trainer_config import pulse_config


def test_presets_are_maxtext_evaluate_rl_values_and_rollout_follows():
  assert PRESETS['greedy'] == Preset(1e-4, 1, 1.0)
  assert PRESETS['standard'] == Preset(0.7, 50, 0.95)
  assert PRESETS['liberal'] == Preset(0.85, 2000, 1.0)
  rollout = RolloutConfig(temperature=0.9, top_k=7, top_p=0.8, min_p=0.05)
  got = EvalConfig(preset='rollout').preset_for(rollout)
  assert got == Preset(0.9, 7, 0.8, 0.05)
  assert EvalConfig(preset='liberal').preset_for(rollout) == PRESETS['liberal']


def test_ks_default_to_1_and_n_and_are_sorted():
  assert EvalConfig().ks == ()  # greedy only
  assert EvalConfig(samples=8).ks == (1, 8)
  assert EvalConfig(samples=1).ks == (1,)
  assert EvalConfig(samples=8, k='8,2,1,2').ks == (1, 2, 8)


@pytest.mark.parametrize(
  'overrides, match',
  [
    (
      dict(eval__samples=4, eval__k='1,8'),
      r"config\.eval\.k: invalid value '1,8' \(k=8 > the 4 samples.*"
      r'allowed: k <= eval\.samples=4',
    ),
    (dict(eval__k='0'), r'config\.eval\.k: .*k < 1'),
    (
      dict(eval__samples=100000),
      r'config\.eval\.samples: invalid value 100000; allowed: an int in '
      r'\[0, 1024\]',
    ),
    (
      dict(eval__preset='hot'),
      r"config\.eval\.preset: invalid value 'hot'; allowed: 'greedy', "
      r"'standard', 'liberal', 'rollout'",
    ),
    (
      dict(eval__sets='{"a": {}, "a": {"ops": "*"}}'),
      r"config\.eval\.sets: .*set 'a' twice.*allowed: a JSON object whose "
      r'set names are unique',
    ),
    (dict(eval__sets='{"a/b": {}}'), r"config\.eval\.sets: .*set name 'a/b'"),
    (dict(eval__sets='[1]'), r'config\.eval\.sets: .*not a non-empty JSON'),
    (
      dict(eval__sets='{"mul": {"opz": "*"}}'),
      r'config\.eval\.sets\.mul has unknown field\(s\) opz; allowed: .*ops',
    ),
    (
      dict(eval__sets='{"mul": {"ops": "/"}}'),
      r"config\.eval\.sets\.mul\.ops: invalid value '/'",
    ),
    (
      dict(eval__sets='{"mul": {"prompts": 0}}'),
      r'config\.eval\.sets\.mul\.prompts: invalid value 0; allowed: an '
      r'integer >= 1',
    ),
    (
      dict(eval__sets='{"t": {"prompt_template": "Q: {prompt}"}}'),
      r'config\.eval\.sets\.t has unknown field\(s\) prompt_template',
    ),
  ],
)
def test_config_errors_name_the_field_and_the_allowed_values(overrides, match):
  with pytest.raises(ValueError, match=match):
    build.build(pulse_config(**overrides))


def test_a_valid_eval_section_builds():
  run = build.build(
    pulse_config(
      eval__samples=4,
      eval__k='1,4',
      eval__preset='liberal',
      eval__sets='{"add": {}, "mul": {"ops": "*", "prompts": 4}}',
    )
  )
  assert run.eval.ks == (1, 4)
  assert list(run.eval.named_sets) == ['add', 'mul']


def test_eval_fields_change_on_resume_and_old_workdirs_resume():
  saved = json.loads(pulse_config().to_json())
  new = json.loads(
    pulse_config(eval__samples=8, eval__sets='{"a": {}}').to_json()
  )
  assert workdir_lib.config_changes(saved, new) == []
  del saved['eval']  # a workdir saved before the eval section
  assert workdir_lib.config_changes(saved, new) == []
