"""Loss aggregation (`agg_loss`) and the KL estimators (`kl_penalty`) against
verl's goldens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.losses import aggregate as agg_lib
from jaxcorr.losses import kl as kl_lib
from tests.helpers import golden_data as gd
from tests.helpers.tolerance import assert_close


@pytest.mark.parametrize('case', gd.case_params('verl', group='agg_loss'))
def test_verl_agg_loss(case):
  gs = gd.load('verl')
  kw = gs.kwargs(case)
  mode = kw['loss_agg_mode']
  mask = kw['loss_mask'].astype(bool)
  err = gs.error(case)
  if mode == 'bad-mode':
    assert err is not None
    with pytest.raises(ValueError, match='allowed: token_mean'):
      agg_lib.aggregate(kw['loss_mat'], mask, mode)
    return
  dp = kw.get('dp_size', 1)
  if err is not None:
    # verl needs its global counts when dp > 1; jaxcorr's arrays are global
    # under jit, so there is no dp factor to forget (spec README, conventions
    # 7): the same call is simply the local aggregation.
    assert 'required when dp_size > 1' in err['message']
    local = gs.case(case['id'].replace('dp2_missing_info', 'local'))
    got = agg_lib.aggregate(kw['loss_mat'], mask, mode)
    assert_close(got, gs.outputs(local)['loss'])
    return
  # verl scales per-rank losses by dp and divides by global counts; the
  # same per-rank value is jaxcorr's loss with counts divided by dp.
  num_tokens = kw.get('batch_num_tokens')
  num_seqs = kw.get('global_batch_size')
  got = agg_lib.aggregate(
    kw['loss_mat'],
    mask,
    mode,
    num_tokens=None if num_tokens is None else num_tokens / dp,
    num_seqs=None if num_seqs is None else num_seqs / dp,
    norm=kw.get('loss_scale_factor'),
  )
  if mode == 'token-sum':
    got = got * dp  # verl multiplies token-sum by dp; jaxcorr does not
  want = gs.outputs(case)['loss']
  assert_close(got, want)


# ------------------------------------------------------------------ verl kl


@pytest.mark.parametrize('case', gd.case_params('verl', group='kl'))
def test_verl_kl_penalty(case):
  gs = gd.load('verl')
  kw = gs.kwargs(case)
  est = kw['kl_penalty']
  if gs.error(case) is not None:
    with pytest.raises(ValueError, match='allowed: k1'):
      kl_lib.kl_penalty(kw['logprob'], kw['ref_logprob'], est)
    return
  mask = gs.dataset()['response_mask'].astype(bool)
  out = gs.outputs(case)

  def masked_sum(lp):
    return jnp.sum(kl_lib.kl_penalty(lp, kw['ref_logprob'], est, mask=mask))

  grad = jax.grad(masked_sum)(kw['logprob'])
  got = kl_lib.kl_penalty(kw['logprob'], kw['ref_logprob'], est, mask=mask)
  assert_close(np.where(mask, got, 0), np.where(mask, out['kl'], 0))
  assert_close(grad, out['grad_logprob_of_masked_sum'])
  # D13: zero outside the mask (verl leaves values in padding).
  assert not np.any(np.asarray(got)[~mask])
