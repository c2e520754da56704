"""The actor objective against slime's goldens: `e2e/*`
(policy_loss_function + loss_function from packed logits)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.losses import correction as corr_lib
from jaxcorr.losses import objective as obj
from jaxcorr.losses import objective_config as obj_cfg
from jaxcorr.losses import policy as pol
from tests.helpers import golden_data as gd
from tests.helpers.tolerance import TOL_GOLDEN_FROM_LOGITS, assert_close

SLIME = gd.load('slime')


def _slime_layout():
  """Packed e2e arrays -> padded [B, T] gather indices and masks."""
  tl = SLIME.array('inputs/e2e_total_lengths')
  rl = SLIME.array('inputs/e2e_response_lengths')
  tok = SLIME.array('inputs/e2e_tokens')
  starts = np.concatenate([[0], np.cumsum(tl)[:-1]])
  b, t = len(rl), int(rl.max())
  pos = np.zeros((b, t), np.int32)
  tgt = np.zeros((b, t), np.int32)
  valid = np.zeros((b, t), bool)
  for i, (s, n, r) in enumerate(zip(starts, tl, rl)):
    pos[i, :r] = np.arange(s + n - r - 1, s + n - 1)  # logits predict t+1
    tgt[i, :r] = tok[s + n - r : s + n]
    valid[i, :r] = True

  def pad(flat):
    out = np.zeros((b, t), np.float32)
    out[valid] = flat
    return out

  return pos, tgt, valid, pad


def _slime_logp_entropy(logits, pos, tgt, temperature):
  lsm = jax.nn.log_softmax(logits[pos] / temperature, axis=-1)
  logp = jnp.take_along_axis(lsm, tgt[..., None], axis=-1)[..., 0]
  entropy = -jnp.sum(jnp.exp(lsm) * lsm, axis=-1)
  return logp, entropy


SLIME_CORR = {
  'tis_vanilla': dict(is_level='token', is_mode='truncate', is_upper=2.0),
  'tis_icepop_0.5_2': dict(
    is_level='token', is_mode='mask', is_lower=0.5, is_upper=2.0
  ),
  'mis_geometric_mask': dict(
    is_level='geometric', is_mode='mask', is_lower=0.9, is_upper=1.1
  ),
  'mismatch_metrics_only': {},  # the `disabled` preset: metrics only
  'mis_yaml_default': dict(
    is_level='token',
    is_mode='truncate',
    is_lower=0.5,
    is_upper=2.0,
    rs='token_k1',
    rs_bounds='0.5_2.0',
    veto_low=1e-4,
    is_batch_normalize=True,
  ),
}
SLIME_SKIP = {
  'kl_loss_k3_unbiased': 'DeepSeek-V3.2 "unbiased" KL (k3 weighted by '
  'π_θ/π_old) is not an objective option in jaxcorr',
  'opsm': 'OPSM (off-policy sequence masking) is not part of jaxcorr',
}


def _slime_run(case_id):
  case = SLIME.case(case_id)
  a = SLIME.kwargs(case)['args']
  pos, tgt, _, pad = _slime_layout()
  mask = pad(SLIME.array('inputs/flat_loss_mask')).astype(bool)
  adv = pad(SLIME.array('inputs/flat_adv_tok'))
  old = pad(SLIME.array('inputs/e2e_old_logprobs'))
  ro = pad(SLIME.array('inputs/e2e_rollout_logprobs'))
  ref = pad(SLIME.array('inputs/e2e_ref_logprobs'))
  name = {'grpo': 'vanilla', 'gspo': 'gspo_seq', 'cispo': 'cispo'}[
    a['advantage_estimator']
  ]
  if name == 'cispo':
    knobs = dict(
      cispo_clip_low=a['eps_clip'], cispo_clip_high=a['eps_clip_high']
    )
  else:
    knobs = dict(
      clip_ratio_low=a['eps_clip'],
      clip_ratio_high=a['eps_clip_high'],
      clip_ratio_c=a['eps_clip_c'],
    )
  # slime's loss is Σ over samples of the per-sample token mean: that is
  # seq_mean_token_mean with num_seqs=1 (or token_sum per token).
  per_token = a['calculate_per_token_loss']
  actor = obj_cfg.ActorLossConfig(
    policy_loss=name,
    agg='token_sum' if per_token else 'seq_mean_token_mean',
    entropy_coeff=a['entropy_coef'],
    kl_loss_type=a['kl_loss_type'],
    kl_loss_coef=a['kl_loss_coef'] if a['use_kl_loss'] else 0.0,
    **knobs,
  )
  short = case_id.split('/')[1]
  args = dict(advantages=adv, mask=mask, ref_logp=ref, num_seqs=1.0)
  if a['use_rollout_logprobs']:  # old := rollout: bypass + ppo_clip
    cc = corr_lib.CorrectionConfig(mode='bypass')
    args.update(rollout_logp=ro)
  elif short in SLIME_CORR:
    cc = corr_lib.CorrectionConfig(**SLIME_CORR[short])
    corr = corr_lib.rollout_correction(old, ro, mask, cc)
    args.update(old_logp=old, correction=corr)
  else:
    cc = None
    args.update(old_logp=old)

  def f(logits):
    logp, ent = _slime_logp_entropy(logits, pos, tgt, a['rollout_temperature'])
    return obj.actor_objective(actor, cc, logp=logp, entropy=ent, **args)

  logits = SLIME.array('inputs/e2e_logits')[0]
  (loss, met), grad = jax.value_and_grad(f, has_aux=True)(logits)
  return case, SLIME.outputs(case), loss, met, np.asarray(grad), args


@pytest.mark.parametrize(
  'case',
  [
    c
    for c in gd.case_params('slime', group='e2e')
    if c.values[0]['id'] != 'e2e/mis_yaml_default'
  ],
)
def test_slime_e2e(case):
  short = case['id'].split('/')[1]
  if short in SLIME_SKIP:
    pytest.skip(SLIME_SKIP[short])
  _, out, loss, met, grad, _ = _slime_run(case['id'])
  assert_close(loss, out['loss'])
  assert_close(grad, out['grad_logits'][0])
  assert_close(met['actor/pg_loss'], out['reported/pg_loss'])
  if 'reported/kl_loss' in out:
    assert_close(met['actor/kl_loss'], out['reported/kl_loss'])
  if short != 'mis_geometric_mask':
    # slime's mask mode removes out-of-band tokens from the mask, so they
    # leave its entropy; jaxcorr keeps them there (verl,
    # docs/math/correction.md §4.3).
    assert_close(
      met['actor/entropy'], out['reported/entropy_loss'], TOL_GOLDEN_FROM_LOGITS
    )


@pytest.mark.golden('slime')
def test_slime_e2e_mis_d5_divergence():
  """slime's MIS divides each sample by its pre-rejection token count.

  Rejected tokens leave slime's loss mask but not `rollout_mask_sums`, so
  their sample's mean is taken over the original length. jaxcorr takes it
  over the corrected mask (D5). Both values are derived from the same
  per-token losses below.
  """
  _, out, loss, met, _, args = _slime_run('e2e/mis_yaml_default')
  corr, mask = args['correction'], args['mask']
  assert (mask & ~np.asarray(corr.mask)).sum() > 0  # some tokens rejected
  pos, tgt, _, _ = _slime_layout()
  logits = SLIME.array('inputs/e2e_logits')[0]
  logp, ent = _slime_logp_entropy(logits, pos, tgt, 1.0)
  per_tok = []
  for i in range(mask.shape[0]):  # per-row token sums through policy_loss
    row = np.zeros_like(mask)
    row[i] = np.asarray(corr.mask)[i]
    per_tok.append(
      pol.policy_loss(
        'vanilla',
        logp,
        args['old_logp'],
        args['advantages'],
        jnp.asarray(row),
        is_weights=corr.weights,
        agg='token_sum',
        knobs=pol.PolicyKnobs(
          clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None
        ),
      )[0]
    )
  sums = np.asarray(per_tok, np.float64)
  pre = SLIME.array('e2e/mis_yaml_default/in/rollout_mask_sums')
  post = np.asarray(corr.mask).sum(-1)
  np.testing.assert_array_equal(pre, mask.sum(-1))
  assert_close(np.sum(sums / pre), out['loss'])  # slime: pre-rejection counts
  assert_close(loss, np.sum(sums / post))  # jaxcorr: corrected counts
  assert abs(float(loss) - out['loss']) > 1e-3
  ent_rows = np.sum(np.where(corr.mask, ent, 0), -1)
  assert_close(np.sum(ent_rows / pre), out['reported/entropy_loss'])
  assert_close(met['actor/entropy'], np.sum(ent_rows / post))
