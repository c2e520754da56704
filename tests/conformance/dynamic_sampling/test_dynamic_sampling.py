"""Dynamic sampling's decisions against verl's `filter_groups` and
NeMo-RL's `use_dynamic_sampling` (`tests/golden/dynamic_sampling`,
re-enacted in numpy by `reference.py`: the frameworks do not run here).

The back-fill runs jaxcorr's own `Filler` over scored rounds whose rows
carry their index in the golden's flattened rounds (response token 0), so
the rows it trains on are compared with the reference's directly.

Divergences (docs/algorithms.md, "Dynamic sampling: divergences"), each
tested below:

* equal is exact: verl's float64 `np.std([0.1] * 3)` is 1.4e-17 > 0, so
  verl keeps that group (it trains with zero advantage); jaxcorr drops it;
* NeMo-RL with the leave-one-out baseline keeps or drops single rows (the
  row that differs sees a std of 0): jaxcorr keeps or drops groups whole;
* NeMo-RL's `dynamic_sampling_max_gen_batches = k` allows k + 1 batches
  (its counter is incremented before the check); verl's and jaxcorr's
  cap k allows k;
* verl's `max_num_gen_batches <= 0` (no cap) is a config-time error.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxcorr.rollout.types import FinishReason, RolloutBatch
from jaxcorr.train import build
from jaxcorr.train.rollouts import dynamic_sampling as ds
from jaxcorr.train.rollouts.stage import Scored
from tests.helpers import golden_data as gd
from tests.helpers.trainer_config import pulse_config

FW = 'dynamic_sampling'


def _kept_rows(values: np.ndarray, n: int) -> np.ndarray:
  return np.stack([np.repeat(ds.kept_groups(v, n), n) for v in values])


def _round(values: np.ndarray, r: int) -> Scored:
  """A scored round: row i's first response token is its index r * B + i
  in the flattened rounds; prompt width 2 + r (rounds of unequal width)."""
  b, p, t = len(values), 2 + r, 2
  ones = np.ones((b, t), bool)
  batch = RolloutBatch(
    prompt_tokens=np.full((b, p), 7, np.int32),
    prompt_mask=np.ones((b, p), bool),
    response_tokens=np.stack([r * b + np.arange(b), np.ones(b)], 1).astype(
      np.int32
    ),
    context_mask=ones,
    response_mask=ones,
    rollout_logp=np.full((b, t), -1.0, np.float32),
    rollout_logp_truncated=np.full((b, t), -1.0, np.float32),
    temperature=np.ones(b, np.float32),
    top_k=np.zeros(b, np.int32),
    top_p=np.ones(b, np.float32),
    min_p=np.zeros(b, np.float32),
    policy_version=np.zeros((b, t), np.int32),
    finish_reason=np.full(b, FinishReason.STOP, np.int8),
    group_id=np.repeat(np.arange(b // 3), 3).astype(np.int32),
    sample_id=np.tile(np.arange(3), b // 3).astype(np.int32),
  )
  return Scored(
    step=0,
    batch=batch,
    rewards=np.zeros(b, np.float32),
    metrics={},
    scores=values[None],
  )


def _fill(values: np.ndarray, cap: int, at_cap: str = 'error'):
  """jaxcorr's rows (indices into the flattened rounds) and rounds."""
  run = build.build(
    pulse_config(
      rollout__samples_per_prompt=3,
      dynamic_sampling__enabled=True,
      dynamic_sampling__metric='exact_match',
      dynamic_sampling__max_gen_rounds=cap,
      dynamic_sampling__at_cap=at_cap,
    )
  )
  filler = ds.Filler(run, ('exact_match',), step=0)
  while filler.add(_round(values[filler.rounds], filler.rounds)):
    pass
  out = filler.result()
  assert out.batch.group_id.tolist() == np.repeat(np.arange(4), 3).tolist()
  rows = out.batch.response_tokens[:, 0]
  # Prompts keep their own width, left-padded to the widest round's.
  assert out.batch.prompt_tokens.shape[1] == 1 + filler.rounds
  np.testing.assert_array_equal(out.batch.prompt_mask.sum(1), 2 + rows // 12)
  assert out.batch.prompt_mask[:, -1].all()
  np.testing.assert_array_equal(out.scores[0], values.reshape(-1)[rows])
  return rows.tolist(), filler.rounds


def test_filter_matches_verl_float32_and_nemo():
  gs = gd.load(FW)
  x = gs.dataset()['values']
  ours = _kept_rows(x, 3)
  for cid in ('verl/filter/float32', 'nemo/filter/loo0'):
    np.testing.assert_array_equal(ours, gs.outputs(gs.case(cid))['kept'])


def test_divergence_verl_float64_keeps_an_equal_group():
  gs = gd.load(FW)
  x = gs.dataset()['values']
  verl = gs.outputs(gs.case('verl/filter/float64'))['kept']
  ours = _kept_rows(x, 3)
  differ = np.argwhere(ours != verl)
  # Round 0, group 3 ([0.1] * 3), only: verl keeps it, jaxcorr drops it.
  assert differ.tolist() == [[0, 9], [0, 10], [0, 11]]
  assert verl[0, 9:].all() and not ours[0, 9:].any()


def test_divergence_nemo_leave_one_out_splits_groups():
  gs = gd.load(FW)
  x = gs.dataset()['values']
  nemo = gs.outputs(gs.case('nemo/filter/loo1'))['kept'].reshape(4, 4, 3)
  split = nemo.any(-1) & ~nemo.all(-1)
  assert split.sum() >= 4  # groups of which NeMo keeps some rows only
  ours = _kept_rows(x, 3).reshape(4, 4, 3)
  assert (ours.all(-1) == ours.any(-1)).all()


@pytest.mark.parametrize('case', gd.case_params(FW, prefix='verl/fill/float32'))
def test_back_fill_matches_verl(case):
  gs = gd.load(FW)
  kw = gs.kwargs(case)
  # verl's cap 0 is "no cap", which jaxcorr refuses: every round given.
  cap = kw['cap'] or len(kw['values'])
  if gs.error(case):
    with pytest.raises(ds.CapReached, match='max_gen_rounds'):
      _fill(kw['values'], cap)
    return
  out = gs.outputs(case)
  rows, rounds = _fill(kw['values'], cap)
  assert rows == out['rows'].tolist()
  assert rounds == out['rounds']


@pytest.mark.parametrize('case', gd.case_params(FW, prefix='nemo/fill/loo0'))
def test_back_fill_matches_nemo_with_one_more_batch(case):
  gs = gd.load(FW)
  kw = gs.kwargs(case)
  cap = kw['cap'] + 1  # NeMo's k allows k + 1 batches
  if gs.error(case):
    with pytest.raises(ds.CapReached):
      _fill(kw['values'], cap)
    return
  rows, rounds = _fill(kw['values'], cap)
  assert rows == gs.outputs(case)['rows'].tolist()
  assert rounds == gs.outputs(case)['rounds']


def test_at_cap_fill_dropped_trains_the_earliest_dropped_groups():
  x = gd.load(FW).dataset()['values']
  rows, rounds = _fill(x, 2, at_cap='fill_dropped')
  # Kept after 2 rounds: (0, 1), (1, 0), (1, 3); then dropped (0, 0).
  assert rounds == 2
  assert rows == [3, 4, 5, 12, 13, 14, 21, 22, 23, 0, 1, 2]


def test_no_cap_is_a_config_error():
  with pytest.raises(ValueError, match=r'max_gen_rounds: invalid value 0'):
    ds.DynamicSamplingConfig(enabled=True, max_gen_rounds=0)
