"""Per-row task ids (jaxcorr/data/task_ids.py): the table a data config
fixes, each prompt's id, and the id surviving what a batch goes through
(dynamic sampling's row picks, assembly, padding)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxcorr.data import task_ids
from jaxcorr.data.config import DataConfig
from jaxcorr.data.tasks import ArithmeticSource, Example
from jaxcorr.train import batch as batch_lib
from jaxcorr.train.rollouts import dynamic_sampling
from tests.helpers.step_batches import synthetic_rollout


def test_task_tables():
  assert task_ids.task_names(DataConfig(ops='*+*')) == ('mul', 'add')
  rg = DataConfig(source='reasoning_gym', task='chain_sum:2,leg_counting:1')
  assert task_ids.task_names(rg) == ('chain_sum', 'leg_counting')
  assert task_ids.task_names(DataConfig(source='code')) == ('code',)


def test_arithmetic_rows_carry_their_operator_task():
  src = ArithmeticSource(40, 0, 9, '+*')
  for ex in src:
    assert ex.task == {'+': 'add', '*': 'mul'}[ex.prompt[1]]


def test_ids_repeat_per_sample_and_mark_unknown_tasks():
  rows = [
    Example('1+1=', '2', 'add'),
    Example('q', 'a'),
    Example('x', 'y', 'z'),
  ]
  ids = task_ids.task_ids(rows, ('add', 'jsonl'), 'jsonl', 2)
  np.testing.assert_array_equal(ids, [0, 0, 1, 1, -1, -1])
  assert ids.dtype == np.int32


def test_task_id_survives_row_picks_assembly_and_padding():
  rb, reward = synthetic_rollout()
  rb = rb.replace(task_id=np.arange(8, dtype=np.int32) % 3)
  picked = dynamic_sampling.concat_rows(
    [dynamic_sampling.take_rows(rb, np.arange(4, 8)), rb]
  )
  np.testing.assert_array_equal(picked.task_id, [1, 2, 0, 1, *rb.task_id])
  out = batch_lib.assemble(
    picked,
    np.concatenate([reward[4:], reward]),
    trainer_version=0,
    max_staleness=None,
    logprob_mode='full',
    row_multiple=8,
  )
  np.testing.assert_array_equal(out.task_id[:12], picked.task_id)
  np.testing.assert_array_equal(out.task_id[12:], [-1] * 4)  # padding rows
  assert out.for_scoring().task_id is None


def test_reasoning_gym_mix_rows_name_their_own_task():
  pytest.importorskip('reasoning_gym')
  from jaxcorr.data.reasoning_gym import ReasoningGymSource

  data = DataConfig(source='reasoning_gym', task='chain_sum,leg_counting')
  src = ReasoningGymSource(data.task, '', 1, 8)
  ids = task_ids.task_ids(list(src), task_ids.task_names(data), 'x', 1)
  assert set(ids) == {0, 1}
