"""Policy losses against slime's goldens."""

from __future__ import annotations

import numpy as np
import pytest

from jaxcorr.losses import policy
from tests.helpers import golden_data as gd
from tests.helpers import policy_replay as pr
from tests.helpers.tolerance import TOL_EQUIVALENT, assert_close

# slime works on packed samples: `flat_*` = row i truncated to lengths[i].
# They are unpacked to [B, T] with padding. `ppo_kl` = old − log_probs, so
# old_logp = flat_old_logprobs. Names: ppo → vanilla (eps_clip,
# eps_clip_high → clip_ratio_low/high, eps_clip_c → clip_ratio_c, None = no
# dual clip), cispo → cispo (its eps_clip bounds), gspo → gspo_seq. The
# gradient is that of Σ pg_losses·loss_mask, i.e. jaxcorr's token_sum.


@pytest.mark.parametrize('case', gd.case_params('slime', group='pl'))
def test_slime_policy_loss(case):
  gs = gd.load('slime')
  kw, out = gs.kwargs(case), gs.outputs(case)
  data, lengths, unpack = pr.packed_inputs(gs)
  fn_name = case['function']
  k = {'clip_ratio_low': kw['eps_clip'], 'clip_ratio_high': kw['eps_clip_high']}
  if 'gspo' in fn_name:
    name = 'gspo_seq'
  elif 'cispo' in fn_name:
    name = 'cispo'
  else:
    name = 'vanilla'
    k['clip_ratio_c'] = kw['eps_clip_c']
  if 'ppo_kl' in kw:  # slime's ppo_kl is exactly old − cur on these inputs
    np.testing.assert_array_equal(
      kw['ppo_kl'], data['flat_old_logprobs'] - data['flat_cur_logprobs']
    )
  logp = unpack(data['flat_cur_logprobs'])
  old = unpack(data['flat_old_logprobs'])
  adv = unpack(kw['advantages'])
  mask = unpack(data['flat_loss_mask']).astype(bool)
  flat_mask = data['flat_loss_mask'].astype(bool)

  def fn(lp):
    return policy.policy_loss(
      name, lp, old, adv, mask, agg='token_sum', knobs=policy.check_knobs(k)
    )

  (loss, metrics), grad = pr.value_grad(fn, logp)
  ell = pr.per_token(name, logp, old, adv, mask, **k)
  assert_close(pr.pack(ell, lengths)[flat_mask], out['pg_losses'][flat_mask])
  abs_terms = float(np.sum(np.abs(out['pg_losses']) * flat_mask))
  assert_close(loss, np.sum(out['pg_losses'] * flat_mask), scale=abs_terms)
  assert_close(
    pr.pack(grad, lengths)[flat_mask],
    out['grad_sum_masked_wrt_log_probs'][flat_mask],
  )
  assert_close(
    metrics['actor/pg_clipfrac'],
    out['clipfrac'][flat_mask].mean(),
    TOL_EQUIVALENT,
  )
