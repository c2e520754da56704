"""VCPO's ESS-scaled step and off-policy optimal baseline against the
authors' code (`tests/golden/vcpo`, mit-han-lab/vcpo re-enacted in numpy
by `reference.py`), the reduces-to cases and the gradient contract.

Divergences (docs/algorithms.md, "VCPO: departures"), tested here:

* no `+1e-8` in the ESS and baseline denominators (relative 1e-8 here);
* `baseline_norm_by_std` divides by jaxcorr's GRPO std (unbiased, +
  `algorithm.eps`), the authors by the population std (no eps).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.losses import advantages as adv_lib
from jaxcorr.losses import rewards as rewards_lib
from jaxcorr.losses import vcpo
from tests.conformance.shaping import reference
from tests.helpers import golden_data as gd

FW = 'vcpo'
EPS = 1e-6  # AdvantageConfig.eps


def _arrays(kw):
  mask = jnp.asarray(kw['mask'])
  log_w = vcpo.seq_log_weights(kw['old_logp'], kw['rollout_logp'], mask)
  return mask, log_w, jnp.any(mask, axis=-1)


@pytest.mark.parametrize('case', gd.case_params(FW, group='ess'))
def test_ess_matches_authors(case):
  gs = gd.load(FW)
  kw, out = gs.kwargs(case), gs.outputs(case)
  _, log_w, valid = _arrays(kw)
  np.testing.assert_allclose(np.exp(log_w), out['seq_is'], rtol=2e-6)
  want = out['metrics']
  rho = vcpo.ess_ratio(log_w, valid)
  np.testing.assert_allclose(rho, want['ess_ratio'], rtol=1e-6)
  scale = vcpo.ess_step_scale(
    rho, rule=kw['scaling_rule'], base=kw['base_ess_ratio']
  )
  np.testing.assert_allclose(scale, want['step_scale'], rtol=1e-6)


def _baseline(kw, norms=None):
  _, log_w, valid = _arrays(kw)
  return vcpo.opob_baseline(
    jnp.asarray(kw['rewards']),
    log_w,
    jnp.asarray(kw['grad_norm_sq'] if norms is None else norms),
    jnp.asarray(kw['lengths']),
    jnp.asarray(kw['group_ids']),
    valid,
    use_is_weights=kw['use_is_weights'],
    normalize_by_length=kw['normalize_by_length'],
  )


@pytest.mark.parametrize('case', gd.case_params(FW, group='opob'))
def test_opob_matches_authors(case):
  gs = gd.load(FW)
  kw, out = gs.kwargs(case), gs.outputs(case)
  base = _baseline(kw)
  np.testing.assert_allclose(base, out['baseline'], rtol=1e-5, atol=1e-7)
  mask = jnp.asarray(kw['mask'])
  adv = vcpo.opob_advantages(
    jnp.asarray(kw['rewards']),
    base,
    mask,
    jnp.asarray(kw['group_ids']),
    norm_by_std=kw['norm_by_std'],
    eps=EPS,
  )
  row = np.asarray(adv)[:, 0]  # every row has its first token
  want = out['advantage']
  if kw['norm_by_std']:
    # Divergence: the authors' population std, jaxcorr's unbiased + eps.
    r = kw['rewards'].reshape(3, 4).astype(np.float64)
    pop = np.repeat(r.std(1), 4)
    unb = np.repeat(r.std(1, ddof=1), 4)
    want = np.where(pop > 1e-8, want * pop / (unb + EPS), want)
  np.testing.assert_allclose(row, want, rtol=1e-5, atol=1e-6)


def test_stored_goldens_are_the_reference_formulas():
  gs = gd.load(FW)
  cases, arrays = reference.vcpo_cases(reference.vcpo_inputs())
  assert [c['id'] for c in cases] == [c['id'] for c in gs.cases()]
  for key, value in arrays.items():
    np.testing.assert_array_equal(gs.array(key), value, err_msg=key)
  for c, stored in zip(cases, gs.cases(), strict=True):
    assert c['outputs'].get('metrics') == stored['outputs'].get('metrics')


def test_on_policy_reduces_to_grpo():
  """w ≡ 1 (π_old = μ) and equal score norms: ρ = 1, the step is not
  scaled, b_g is the group mean and the advantage is GRPO's."""
  kw = gd.load(FW).kwargs(gd.load(FW).case('opob/is1_len0_std1'))
  kw['rollout_logp'] = kw['old_logp']
  mask, log_w, valid = _arrays(kw)
  rho = vcpo.ess_ratio(log_w, valid)
  assert float(rho) == 1.0
  assert float(vcpo.ess_step_scale(rho, rule='sqrt', base=1.0)) == 1.0
  rewards = jnp.asarray(kw['rewards'])
  ids = jnp.asarray(kw['group_ids'])
  base = _baseline(kw, norms=np.full(12, 2.5, np.float32))
  np.testing.assert_allclose(
    base, np.repeat(kw['rewards'].reshape(3, 4).mean(1), 4), rtol=1e-6
  )
  scores = rewards_lib.place_at_last_token(rewards, mask)
  for std in (True, False):
    grpo, _ = adv_lib.compute_advantages(
      'grpo', scores, mask, ids, norm_adv_by_std=std, eps=EPS
    )
    got = vcpo.opob_advantages(
      rewards, base, mask, ids, norm_by_std=std, eps=EPS
    )
    np.testing.assert_allclose(got, grpo, rtol=1e-6, atol=1e-7)


def test_gradient_contract():
  """The weights, the ratio, the scale, the baseline and the advantages
  carry no gradient: they are computed from π_old, μ and the rewards, and
  only scale or feed the loss."""
  gs = gd.load(FW)
  kw = gs.kwargs(gs.case('opob/is1_len0_std1'))
  mask = jnp.asarray(kw['mask'])
  ids = jnp.asarray(kw['group_ids'])

  def through(old, rollout, rewards):
    log_w = vcpo.seq_log_weights(old, rollout, mask)
    valid = jnp.any(mask, axis=-1)
    base = vcpo.opob_baseline(
      rewards, log_w, jnp.ones(12), jnp.ones(12), ids, valid
    )
    adv = vcpo.opob_advantages(rewards, base, mask, ids, norm_by_std=True)
    return jnp.sum(adv) + jnp.sum(log_w)

  args = (
    jnp.asarray(kw['old_logp']),
    jnp.asarray(kw['rollout_logp']),
    jnp.asarray(kw['rewards']),
  )
  for g in jax.grad(through, argnums=(0, 1, 2))(*args):
    assert not np.any(np.asarray(g))


def test_ess_is_finite_where_the_weights_overflow_and_zero_when_empty():
  log_w = jnp.asarray([200.0, 200.0, 0.0, 5.0])
  valid = jnp.asarray([True, True, True, False])
  np.testing.assert_allclose(vcpo.ess_ratio(log_w, valid), 2 / 3, rtol=1e-5)
  assert float(vcpo.ess_ratio(log_w, jnp.zeros(4, bool))) == 0.0
  dead = jnp.asarray([-jnp.inf, -jnp.inf])
  assert float(vcpo.ess_ratio(dead, jnp.ones(2, bool))) == 0.0
