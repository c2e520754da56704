"""The deliberate divergence of the KL estimators from slime (D11): jaxcorr's
k3 is the clamped low-variance estimator."""

import numpy as np

from jaxcorr.losses import kl as kl_lib
from tests.helpers import golden_data as gd


def test_d11_slime_k3_outliers_are_clamped_in_jaxcorr():
  gs = gd.load('slime')
  kw = gs.kwargs(gs.case('kl/k3/old_vs_rollout_outliers'))
  want = gs.outputs(gs.case('kl/k3/old_vs_rollout_outliers'))['kl']
  got = np.asarray(
    kl_lib.kl_penalty(kw['log_probs'], kw['log_probs_base'], 'k3')
  )
  assert np.max(want) > 10  # slime: unbounded at the ±5 outliers
  assert np.max(got) <= 10  # jaxcorr: low-variance estimator is bounded
