"""Loss reduction and the KL estimators (`compute_approx_kl`) against SkyRL's
goldens."""

import numpy as np
import pytest

from jaxcorr.losses import aggregate as agg_lib
from jaxcorr.losses import kl as kl_lib
from tests.helpers import golden_data as gd
from tests.helpers.tolerance import assert_close


def _skyrl_reduced(case, adv, mask):
  """jaxcorr's aggregate of A under SkyRL's loss_reduction."""
  gs = gd.load('skyrl')
  kw = gs.kwargs(case)
  mode = kw['loss_reduction']
  if mode == 'token_mean':
    return agg_lib.aggregate(adv, mask, 'token_mean')
  if mode == 'sequence_mean':
    return agg_lib.aggregate(adv, mask, 'seq_mean_token_mean')
  if mode == 'seq_mean_token_sum_norm':
    return agg_lib.aggregate(
      adv, mask, 'seq_mean_token_sum_norm', norm=kw['max_seq_len']
    )
  if mode == 'token_mean_legacy':
    # Mean over micro-batches of each micro-batch's token mean.
    mbs = kw['micro_batch_size']
    parts = [
      agg_lib.aggregate(adv[i : i + mbs], mask[i : i + mbs], 'token_mean')
      for i in range(0, adv.shape[0], mbs)
    ]
    return sum(parts) / len(parts)
  if mode == 'prompt_mean':
    parts = [
      agg_lib.aggregate(adv[a:b], mask[a:b], 'token_mean')
      for a, b in kw['prompt_boundaries']
    ]
    return sum(parts) / len(parts)
  raise AssertionError(mode)


@pytest.mark.parametrize('case', gd.case_params('skyrl', group='reduction'))
def test_skyrl_reduction(case):
  # SkyRL folds the reduction into the advantages: Σ scaled·m is the
  # reduced loss of the per-token values A.
  gs = gd.load('skyrl')
  kw = gs.kwargs(case)
  mask = kw['loss_mask'].astype(bool)
  want = np.sum(gs.outputs(case)['advantages'] * mask)
  got = _skyrl_reduced(case, kw['advantages'], mask)
  assert_close(got, want)


# ----------------------------------------------------------------- skyrl kl


@pytest.mark.parametrize('case', gd.case_params('skyrl', group='kl'))
def test_skyrl_compute_approx_kl(case):
  gs = gd.load('skyrl')
  kw = gs.kwargs(case)
  want = gs.outputs(case)['kld']
  mask = kw.get('loss_mask')
  if mask is None:
    # Unmasked: the caller passes clean inputs; compare on the valid tokens.
    valid = gs.dataset()['loss_mask'].astype(bool)
    got = kl_lib.kl_penalty(
      kw['log_probs'], kw['log_probs_base'], kw['kl_estimator_type']
    )
    assert_close(np.asarray(got)[valid], want[valid])
    return
  mask = mask.astype(bool)
  got = kl_lib.kl_penalty(
    kw['log_probs'], kw['log_probs_base'], kw['kl_estimator_type'], mask=mask
  )
  # SkyRL zeroes masked positions (torch.where), so compare everywhere;
  # its inputs hold NaN there in `nan_at_masked_positions`.
  assert_close(got, want)
