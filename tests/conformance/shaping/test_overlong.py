"""Overlong shaping against verl's DAPO reward manager and TRL's
`mask_truncated_completions` (`tests/golden/overlong`, re-enacted in numpy
by `reference.py`: the frameworks do not run here).

Divergences (docs/algorithms.md, "Overlong shaping: divergences"), each
tested below:

* truncation is `finish_reason == LENGTH`, not TRL's "last token is not
  EOS/pad": a multi-turn trajectory cut by `agent.max_turns` after a turn
  that ended with EOS is truncated in jaxcorr, complete in TRL;
* a buffer longer than the budget is a config-time ValueError naming
  `config.reward.overlong_buffer_len` (verl: an AssertionError at start-up);
  an enabled buffer of 0 is one too (verl divides by zero).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.losses import overlong
from jaxcorr.rewards.config import RewardConfig
from jaxcorr.rollout.types import FinishReason
from tests.conformance.shaping import reference
from tests.helpers import golden_data as gd

FW = 'overlong'


@pytest.mark.parametrize('case', gd.case_params(FW, group='dapo', errors=False))
def test_penalty_matches_verl(case):
  gs = gd.load(FW)
  kw, out = gs.kwargs(case), gs.outputs(case)
  pen = overlong.overlong_penalty(
    jnp.asarray(kw['attention_mask_response']),
    max_len=kw['max_resp_len'],
    buffer_len=kw['overlong_buffer_len'],
    penalty_factor=kw['overlong_penalty_factor'],
  )
  # One ulp: XLA divides a vector by a scalar through its reciprocal.
  np.testing.assert_allclose(pen, out['overlong_reward'], rtol=2e-7, atol=0)
  np.testing.assert_array_equal(np.asarray(pen) < 0, out['overlong'])
  np.testing.assert_allclose(
    kw['scores'] + np.asarray(pen), out['reward'], rtol=0, atol=1e-7
  )


def test_buffer_longer_than_budget_is_a_config_error():
  gs = gd.load(FW)
  case = gs.case('dapo/error_buffer_longer')
  kw = gs.kwargs(case)
  assert gs.error(case)['type'] == 'AssertionError'
  cfg = RewardConfig(
    overlong_buffer_enable=True,
    overlong_buffer_len=kw['overlong_buffer_len'],
  )
  with pytest.raises(ValueError, match=r'config.reward.overlong_buffer_len'):
    overlong.check_max_length(cfg, kw['max_resp_len'], 'config.reward')
  overlong.check_max_length(cfg, kw['overlong_buffer_len'], 'config.reward')
  with pytest.raises(ValueError, match=r'overlong_buffer_len.*>= 1'):
    RewardConfig(overlong_buffer_enable=True, overlong_buffer_len=0)
  RewardConfig(overlong_buffer_enable=False, overlong_buffer_len=0)


def test_mask_matches_trl_but_where_max_turns_cut_an_eos_turn():
  gs = gd.load(FW)
  case = gs.case('trl/mask')
  kw, out = gs.kwargs(case), gs.outputs(case)
  finish = gs.array('inputs/finish_reason')
  truncated = finish == FinishReason.LENGTH
  got = np.asarray(
    overlong.mask_truncated(jnp.asarray(kw['completion_mask'] > 0), truncated)
  )
  want = out['completion_mask'] > 0
  differs = np.flatnonzero((got != want).any(-1))
  assert differs.tolist() == [10]  # the max_turns row (module docstring)
  assert truncated[10] and not out['is_truncated'][10]
  same = np.arange(len(finish)) != 10
  np.testing.assert_array_equal(truncated[same], out['is_truncated'][same])
  np.testing.assert_array_equal(got[same], want[same])


def test_stored_goldens_are_the_reference_formulas():
  """The data in tests/golden/overlong is what reference.py computes."""
  gs = gd.load(FW)
  cases, arrays = reference.overlong_cases(reference.overlong_inputs())
  assert [c['id'] for c in cases] == [c['id'] for c in gs.cases()]
  for key, value in arrays.items():
    np.testing.assert_array_equal(gs.array(key), value, err_msg=key)


def test_penalty_is_zero_before_the_ramp_and_jits_on_empty_rows():
  mask = np.arange(8)[None] < np.array([0, 4, 5, 8])[:, None]
  pen = overlong.overlong_penalty(
    jnp.asarray(mask), max_len=8, buffer_len=4, penalty_factor=1.0
  )
  np.testing.assert_array_equal(np.asarray(pen), [0, 0, -0.25, -1.0])
