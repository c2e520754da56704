"""The actor objective against prime-rl's goldens:
`head/compute_loss/default/rl_only`."""

import dataclasses

import numpy as np
import pytest

from tests.helpers import golden_data as gd
from tests.helpers import objective_batches as ob
from tests.helpers.tolerance import assert_close

PRIME = gd.load('prime')
PRIME_SKIP = {
  'head/compute_loss/default/rl_weights_ce_refkl': 'per-token rl/ce/ref-KL '
  'component weights and scales are prime-rl trainer features, not part of '
  'the jaxcorr objective',
  'head/compute_loss/ipo/rl_only': "prime-rl's IPO loss is not in the "
  'jaxcorr registry',
  'head/compute_loss/ipo/rl_weights_ce_refkl': "prime-rl's IPO loss is not "
  'in the jaxcorr registry',
}


def _prime_inputs(case):
  kw = PRIME.kwargs(case)
  return (
    kw,
    kw['trainer_logprobs'][None],
    kw['inference_logprobs'][None],
    kw['advantages'][None],
    kw['loss_mask'][None].astype(bool),
  )


@pytest.mark.parametrize(
  'case', gd.case_params('prime', group='head/compute_loss')
)
def test_prime_compute_loss(case):
  """prime_dppo_kl preset (bypass + prime, token_mean) == prime-rl."""
  if case['id'] in PRIME_SKIP:
    pytest.skip(PRIME_SKIP[case['id']])
  kw, lp, ro, adv, mask = _prime_inputs(case)
  assert kw['rl_scale'] == mask.sum()  # global token count = token_mean
  actor, cc = ob.preset('prime_dppo_kl')
  lc = kw['loss_config']
  actor = dataclasses.replace(
    actor,
    prime_mask_low=lc['dppo_mask_low'],
    prime_mask_high=lc['dppo_mask_high'],
    prime_adv_tau=lc['adv_tau'],
    prime_kl_tau=lc['kl_tau'],
  )
  loss, met, grad = ob.grad_logp(
    actor, cc, lp, jit=True, advantages=adv, mask=mask, rollout_logp=ro
  )
  out = PRIME.outputs(case)
  assert_close(loss, out['loss'])
  assert_close(grad[0], out['grad_trainer_logprobs'])
  # Per-sample metrics, token-weighted, are jaxcorr's pooled ones.
  sizes = np.diff(
    np.concatenate([[0], np.cumsum(PRIME.array('inputs/lengths'))])
  )
  rows = np.split(mask[0], np.cumsum(sizes)[:-1])
  n_i = np.array([r.sum() for r in rows])
  pooled = np.sum(out['metric/is_masked'] * n_i) / n_i.sum()
  assert_close(met['actor/prime_is_masked'], pooled)


@pytest.mark.golden('prime')
def test_prime_kl_tau_is_rollout_kl():
  """docs/math/losses.md §6: `prime` with τ_KL = 0 plus `+rollout_kl` (k2, 2e-3)
  == prime-rl."""
  case = PRIME.case('head/compute_loss/default/rl_only')
  _, lp, ro, adv, mask = _prime_inputs(case)
  actor, cc = ob.preset('prime_dppo_kl+rollout_kl')
  actor = dataclasses.replace(actor, prime_kl_tau=0.0)
  assert actor.rollout_kl_coef == 2 * 1e-3 and actor.rollout_kl_type == 'k2'
  loss, met, grad = ob.grad_logp(
    actor, cc, lp, jit=True, advantages=adv, mask=mask, rollout_logp=ro
  )
  out = PRIME.outputs(case)
  assert_close(loss, out['loss'])
  assert_close(grad[0], out['grad_trainer_logprobs'])
  assert float(met['actor/rollout_kl_loss']) > 0
