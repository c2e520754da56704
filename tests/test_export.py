"""`jaxcorr.export` from the checkpoint alone: no Trainer, no data, no
reward registry; a clear error without checkpoints; the tokenizer's end
token in the exported config.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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


def test_out_in_a_run_or_non_empty_is_refused(tmp_path):
  """`--out` equal to the workdir used to replace the run's config.json by
  the HF one (exit 0, the run lost); now that, a directory inside it or
  inside another run, is refused before anything is written, and a
  non-empty directory needs `force`."""
  workdir, _ = _run_dir(tmp_path)
  saved = (workdir / 'config.json').read_bytes()
  for out in (workdir, workdir / 'hf', workdir / '.' / 'hf' / 'deeper'):
    with pytest.raises(ValueError, match='the run directory'):
      export.export(str(workdir), str(out))
  other = tmp_path / 'other_run'
  (other / 'checkpoints').mkdir(parents=True)
  (other / 'config.json').write_text('{}')
  with pytest.raises(
    ValueError, match=r'is inside a run directory .*other_run'
  ):
    export.export(str(workdir), str(other / 'hf'), force=True)
  busy = tmp_path / 'models'
  busy.mkdir()
  (busy / 'notes.txt').write_text('mine')
  with pytest.raises(ValueError, match=r'non-empty directory.*--force'):
    export.export(str(workdir), str(busy))
  export.check_out(str(workdir), str(busy), force=True)
  export.check_out(str(workdir), str(tmp_path / 'new'))
  # A directory merely named like a run's parts is no run.
  (tmp_path / 'checkpoints').mkdir()
  export.check_out(str(workdir), str(tmp_path / 'checkpoints' / 'hf'))

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(
    [
      sys.executable,
      '-m',
      'jaxcorr.export',
      f'--workdir={workdir}',
      f'--out={workdir}',
    ],
    cwd=root,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode != 0, proc.stdout
  assert 'is the run directory' in proc.stderr, proc.stderr
  assert (workdir / 'config.json').read_bytes() == saved
  assert sorted(p.name for p in workdir.iterdir()) == ['config.json']


@pytest.mark.parametrize('dtype', [None, 'bfloat16'])
def test_adapter_export_writes_the_dtype_asked_for(tmp_path, dtype):
  """`--adapter --dtype=bfloat16` writes bfloat16 PEFT tensors (it wrote
  float32 whatever --dtype said); without --dtype, float32."""
  from safetensors import safe_open

  from jaxcorr.train import build, setup
  from jaxcorr.train.checkpoints.resume import Progress, RunCheckpoints
  from jaxcorr.train.policy import build_policy
  from tests.helpers.step_batches import one_device_mesh

  config = pulse_config(lora__rank=2, train__sft_steps=0)
  run = build.build(config)
  mesh = one_device_mesh()
  state = setup.build_learner(
    run, build_policy(run.model, mesh, run.lora), mesh
  )[0]
  workdir = tmp_path / 'run'
  ckpt = RunCheckpoints(str(workdir), run, 'pulse', config=config)
  ckpt.save(Progress(step=1), state, None, force=True)
  ckpt.close()
  (workdir / 'config.json').write_text(config.to_json())
  out = tmp_path / 'adapter'
  export.export(str(workdir), str(out), adapter=True, dtype=dtype)
  with safe_open(out / 'adapter_model.safetensors', 'np') as f:
    names = list(f.keys())
    kinds = {f.get_slice(k).get_dtype() for k in names}
  assert kinds == {'BF16' if dtype else 'F32'}
