"""`train.profile_steps`: the steps it names, and a trace a viewer opens."""

from __future__ import annotations

import glob
import os

import jax
import jax.numpy as jnp
import pytest

from jaxcorr.train import build
from jaxcorr.train.tracker.profile import StepProfiler, parse_steps
from tests.helpers.trainer_config import pulse_config


def test_steps_parse_and_errors_name_the_field():
  assert parse_steps('3, 5-6') == {3, 5, 6}
  assert parse_steps('') == frozenset()
  run = build.build(pulse_config(train__profile_steps='5-6,3'))
  assert run.train.profile_steps == '3,5,6'
  with pytest.raises(ValueError, match=r'config\.train\.profile_steps'):
    build.build(pulse_config(train__profile_steps='0-2'))


def test_trace_of_the_chosen_steps_is_written(tmp_path):
  prof = StepProfiler('2-3', str(tmp_path))  # traces to tmp_path/profile
  f = jax.jit(lambda x: jnp.sin(x) @ x)
  x = jnp.ones((64, 64))
  for step in (1, 2, 3, 4):
    with prof.step(step):
      f(x).block_until_ready()
      assert prof.active == (step in (2, 3))
  assert not prof.active
  runs = glob.glob(os.path.join(tmp_path, 'profile', 'plugins', 'profile', '*'))
  assert len(runs) == 1  # steps 2 and 3: one trace
  files = os.listdir(runs[0])
  assert any(f.endswith('.xplane.pb') for f in files), files  # TensorBoard
  assert any(f.endswith('.trace.json.gz') for f in files), files  # Perfetto
