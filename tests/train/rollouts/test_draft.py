"""The `speculative` section at start-up (jaxcorr/train/rollouts/draft.py):
one-line errors naming the field for what the engine cannot run, a draft
checkpoint with another tokenizer or vocabulary, a bad path; the old
`rollout.speculative_*` names of saved runs still load."""

from __future__ import annotations

import json

import pytest

from jaxcorr.train import build
from jaxcorr.train.checkpoints import workdir as workdir_lib
from jaxcorr.train.rollouts import draft
from tests.helpers.model_testing import foreign_tokenizer_hf_dir
from tests.helpers.trainer_config import pulse_config


def _workdir(path, **model):
  """A draft workdir as the trainer writes one: the run's config.json
  (pulse model, `model` overrides) and a checkpoints/ folder."""
  config = pulse_config()
  for key, value in model.items():
    config.model[key] = value
  path.mkdir()
  (path / 'checkpoints').mkdir()
  (path / 'config.json').write_text(config.to_json())
  return str(path)


def _config(**speculative):
  config = pulse_config()
  for key, value in speculative.items():
    config.speculative[key] = value
  return config


def _one_line_error(config, match):
  with pytest.raises(ValueError, match=match) as e:
    build.build(config)
  assert '\n' not in str(e.value)


@pytest.mark.parametrize(
  'spec, rollout, match',
  [
    (dict(draft='eagle'), {}, r'config\.speculative\.draft: invalid'),
    (dict(draft='ngram', k=0), {}, r'config\.speculative\.k: invalid value 0'),
    (dict(draft='ngram'), dict(exact=True), r'config\.rollout\.exact'),
    (
      dict(draft='layers'),
      dict(logprob_mode='replay'),
      r'config\.rollout\.logprob_mode',
    ),
    (dict(draft='layers', draft_layers=2), {}, r'draft_layers: .*\[1, model'),
    (dict(draft='model'), {}, r'config\.speculative\.draft_model: invalid'),
    (dict(draft_model='/x'), {}, r'config\.speculative\.draft_model: invalid'),
  ],
)
def test_what_speculation_cannot_run_fails_at_config_time(spec, rollout, match):
  config = _config(**spec)
  for key, value in rollout.items():
    config.rollout[key] = value
  _one_line_error(config, match)


def test_an_moe_policy_is_refused():
  config = _config(draft='ngram')
  config.model.architecture = 'MixtralForCausalLM'
  config.model.num_experts = 4
  config.model.num_experts_per_tok = 2
  _one_line_error(config, r'config\.speculative\.draft: .*MoE')


def test_a_matching_checkpoint_draft_passes(tmp_path):
  path = _workdir(tmp_path / 'd', num_layers=1)
  run = build.build(_config(draft='model', draft_model=path + '@0'))
  src, cfg = draft.check_for_run(run)
  assert (src.kind, src.step, cfg.num_layers) == ('workdir', 0, 1)


def test_a_missing_draft(tmp_path):
  config = _config(draft='model', draft_model=str(tmp_path / 'nowhere'))
  _one_line_error(config, r'config\.speculative\.draft_model.*no such')


def test_a_draft_with_another_vocabulary(tmp_path):
  path = _workdir(tmp_path / 'd', vocab_size=64)
  _one_line_error(
    _config(draft='model', draft_model=path),
    r"config\.speculative\.draft_model.*vocab_size is 64.*policy's vocabulary \(27\)",
  )


def test_a_draft_with_another_tokenizer_names_both(tmp_path):
  """An HF draft (its tokenizer.json) for a scratch-tokenizer policy."""
  path = foreign_tokenizer_hf_dir(tmp_path / 'hf')
  _one_line_error(
    _config(draft='model', draft_model=path),
    r'draft_model.*draft hf:.* vs policy scratch:',
  )


def test_a_run_saved_with_the_rollout_speculative_fields_loads(tmp_path):
  """`rollout.speculative_*` are `speculative.*` now."""
  new = json.loads(_config(draft='ngram', k=3).to_json())
  saved = json.loads(json.dumps(new))
  spec = saved.pop('speculative')
  for name in ('draft', 'k', 'ngram', 'draft_layers'):
    saved['rollout'][f'speculative_{name}'] = spec[name]
  assert workdir_lib.config_changes(saved, new) == []
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  got = workdir_lib.read_config(str(tmp_path))
  assert got['speculative']['draft'] == 'ngram' and got['speculative']['k'] == 3
  assert not any(k.startswith('speculative') for k in got['rollout'])
