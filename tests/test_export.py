"""`jaxcorr.export` from the checkpoint alone: no Trainer, no data, no
reward registry; a clear error without checkpoints; the tokenizer's end
token in the exported config.json."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from jaxcorr import export
from jaxcorr.model import load_hf
from jaxcorr.train.checkpoints import checkpointer as checkpoint
from tests.helpers.model_testing import random_model
from tests.helpers.trainer_config import pulse_config


def _run_dir(tmp_path):
  """A workdir as a pulse run leaves it, written without a Trainer: the
  config names data and a reward this process does not have."""
  config = pulse_config(
    data__source='jsonl',
    data__path=str(tmp_path / 'moved_away.jsonl'),
    reward__functions='a_reward_registered_elsewhere',
  )
  workdir = tmp_path / 'run'
  workdir.mkdir()
  (workdir / 'config.json').write_text(config.to_json())
  return workdir, export.model_config(config)


def test_export_from_the_checkpoint_alone(tmp_path):
  workdir, cfg = _run_dir(tmp_path)
  model = random_model(cfg)
  params = nnx.state(model)
  state = {
    'params': params,
    'opt_state': {'mu': jax.tree.map(np.zeros_like, nnx.to_pure_dict(params))},
    'updates': np.int32(7),
  }
  with checkpoint.Checkpointer(
    str(workdir / 'checkpoints'), every=1, keep=3
  ) as ckpt:
    ckpt.save(4, {'state': state, 'ref': None}, {'step': 4})
  step = export.export(str(workdir), str(tmp_path / 'hf'))
  assert step == 4
  hf = json.loads((tmp_path / 'hf' / 'config.json').read_text())
  # The character tokenizer's ids: transformers' generate stops at EOS.
  assert (hf['eos_token_id'], hf['bos_token_id'], hf['pad_token_id']) == (
    2,
    1,
    0,
  )
  loaded = load_hf(tmp_path / 'hf')
  a = jax.tree.leaves(nnx.state(loaded, nnx.Param))
  b = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_workdir_without_checkpoints_is_a_clear_error(tmp_path):
  workdir, _ = _run_dir(tmp_path)
  with pytest.raises(
    FileNotFoundError, match=r'no checkpoint in .*checkpoints'
  ):
    export.export(str(workdir), str(tmp_path / 'hf'))
  (workdir / 'checkpoints' / '3.orbax-checkpoint-tmp-1').mkdir(parents=True)
  with pytest.raises(FileNotFoundError, match='has not saved a step yet'):
    export.export(str(workdir), str(tmp_path / 'hf'))
  assert not (tmp_path / 'hf').exists()
  with pytest.raises(FileNotFoundError, match=r'config\.json not found'):
    export.export(str(tmp_path), str(tmp_path / 'hf'))
