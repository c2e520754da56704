"""Micro-batches with global normalisers reproduce the full batch
(decoupled, and bypass with rejection through `aggregate_terms`), and the
normalisers themselves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.losses import aggregate as agg_lib
from jaxcorr.losses import correction as corr_lib
from jaxcorr.losses import objective as obj
from jaxcorr.losses import objective_config as obj_cfg
from tests.helpers import objective_batches as ob
from tests.helpers.tolerance import TOL_REORDERED, assert_close

MICRO = (slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8))


@pytest.mark.parametrize(
  'mode', ['token_mean', 'token_sum', 'seq_mean_token_sum_norm', None]
)
def test_micro_batches_with_global_normalizers_decoupled(mode):
  """Decoupled: counts of the corrected mini-batch mask, split in 4."""
  data = ob.batch()
  name = 'gspo' if mode is None else 'vanilla'  # None: mixed divisors
  actor = obj_cfg.ActorLossConfig(policy_loss=name, agg=mode, **ob.ALL_TERMS)
  cc = ob.RS_DECOUPLED
  rest = {k: v for k, v in data.items() if k != 'logp'}

  @jax.jit
  def both(lp):
    corr = corr_lib.rollout_correction(
      rest['old_logp'], rest['rollout_logp'], rest['mask'], cc
    )

    def full(x):
      return obj.actor_objective(
        actor, cc, logp=x, correction=corr, norm=16.0, **rest
      )[0]

    n_tok, n_seq = obj.loss_normalizers(corr.mask)

    def split(x):
      total = 0.0
      for s in MICRO:
        part = corr_lib.Correction(corr.weights[s], corr.mask[s], corr.metrics)
        total += obj.actor_objective(
          actor,
          cc,
          logp=x[s],
          correction=part,
          num_tokens=n_tok,
          num_seqs=n_seq,
          norm=16.0,
          **ob.rows(rest, s),
        )[0]
      return total

    kept = jnp.sum(jnp.any(corr.mask, -1))
    return jax.value_and_grad(full)(lp), jax.value_and_grad(split)(lp), kept

  (v0, g0), (v1, g1), kept = both(jnp.asarray(data['logp']))
  assert 0 < kept < data['mask'].any(-1).sum()  # RS rejected rows
  assert_close(v1, v0, TOL_REORDERED)
  assert_close(g1, g0, TOL_REORDERED)


@pytest.mark.parametrize(
  'mode', ['token_mean', 'token_sum', 'seq_mean_token_sum_norm']
)
def test_micro_batches_bypass_rejection_aggregate_terms(mode):
  """Bypass + RS: unit normalisers, accumulate, divide once (aggregate_terms).

  The mask depends on π_θ, so each micro-batch's count is only known after
  its forward pass: every call uses num_tokens = num_seqs = 1, which makes
  each term its `aggregate_terms` numerator; the counts come back in the
  metrics; the sums are divided once at the end.
  """
  data = ob.batch(seed=1)
  actor = obj_cfg.ActorLossConfig(
    policy_loss='reinforce', agg=mode, **ob.ALL_TERMS
  )
  cc = ob.RS_BYPASS
  kind = obj_cfg.normalizer_kind(actor)
  assert kind == {'token_sum': 'none', 'token_mean': 'tokens'}.get(mode, 'seqs')
  key = 'actor/loss_seq_count' if kind == 'seqs' else 'actor/loss_token_count'
  rest = {k: v for k, v in data.items() if k not in ('logp', 'old_logp')}

  @jax.jit
  def full(lp):
    def f(x):
      return obj.actor_objective(actor, cc, logp=x, norm=16.0, **rest)

    return jax.value_and_grad(f, has_aux=True)(lp)

  @jax.jit
  def unit(lp, part):
    def f(x):
      return obj.actor_objective(
        actor, cc, logp=x, num_tokens=1, num_seqs=1, norm=16.0, **part
      )

    (v, met), g = jax.value_and_grad(f, has_aux=True)(lp)
    # aggregate_terms' count on this micro-batch's corrected mask.
    corr = corr_lib.rollout_correction(
      lp, part['rollout_logp'], part['mask'], cc
    )
    _, cnt = agg_lib.aggregate_terms(
      jnp.zeros(corr.mask.shape), corr.mask, mode
    )
    return v, met[key], g, cnt

  (v_full, met_full), g_full = full(jnp.asarray(data['logp']))
  assert 0 < met_full['actor/loss_seq_count'] < data['mask'].any(-1).sum()
  num, cnt, grads = 0.0, 0.0, []
  for s in MICRO:
    v, c, g, want_c = unit(jnp.asarray(data['logp'][s]), ob.rows(rest, s))
    if kind != 'none':
      assert float(c) == float(want_c)
    num, cnt = num + v, cnt + c
    grads.append(g)
  grad = jnp.concatenate(grads)
  assert_close(agg_lib.finalize(num, cnt, mode), v_full, TOL_REORDERED)
  assert_close(grad if kind == 'none' else grad / cnt, g_full, TOL_REORDERED)


def test_normalizer_kind():
  kind = obj_cfg.normalizer_kind
  assert kind(obj_cfg.ActorLossConfig()) == 'tokens'
  assert kind(obj_cfg.ActorLossConfig(policy_loss='gspo')) == 'seqs'
  assert kind(
    obj_cfg.ActorLossConfig(policy_loss='gspo', kl_loss_coef=0.1)
  ) == ('mixed')
  assert kind(
    obj_cfg.ActorLossConfig(policy_loss='gspo', entropy_coeff=0.1)
  ) == ('mixed')
  assert kind(obj_cfg.ActorLossConfig(rollout_kl_coef=0.1)) == 'tokens'
  cfg = obj_cfg.ActorLossConfig(
    policy_loss='gspo', agg='token_sum', kl_loss_coef=1
  )
  assert kind(cfg) == 'none'


def test_loss_normalizers_count_corrected_mask():
  mask = np.array([[1, 1, 0], [0, 0, 0], [0, 1, 0]], bool)
  n_tok, n_seq = obj.loss_normalizers(mask)
  assert float(n_tok) == 3.0 and float(n_seq) == 2.0
  with pytest.raises(ValueError, match='bool'):
    obj.loss_normalizers(mask.astype(np.float32))
