"""The objective's metrics (keys fixed by the config, counts on the corrected
mask) and its errors (mode mix-ups, missing arrays, trace-time shape and
dtype checks, compatibility checked once per config pair)."""

import jax
import numpy as np
import pytest

from jaxcorr.losses import correction as corr_lib
from jaxcorr.losses import objective as obj
from jaxcorr.losses import objective_config as obj_cfg
from tests.helpers import objective_batches as ob
from tests.helpers.tolerance import assert_close


def test_metric_keys_depend_only_on_config():
  data = ob.batch(seed=11)
  actor = obj_cfg.ActorLossConfig(**ob.ALL_TERMS)
  _, met, _ = ob.run_objective(actor, None, data)
  assert set(met) == {
    'actor/pg_loss',
    'actor/entropy',
    'actor/kl_loss',
    'actor/kl_coef',
    'actor/rollout_kl_loss',
    'actor/rollout_kl_coef',
    'actor/loss_token_count',
    'actor/loss_seq_count',
    'actor/pg_clipfrac',
    'actor/pg_clipfrac_lower',
    'actor/ppo_kl',
  }
  d = {k: v for k, v in data.items() if k != 'entropy'}
  _, met, _ = ob.run_objective(obj_cfg.ActorLossConfig(), None, d)
  assert 'actor/entropy' not in met and 'actor/kl_loss' not in met
  assert 'actor/rollout_kl_loss' not in met
  # Bypass merges the correction's metrics; decoupled does not (the trainer
  # logs the once-per-batch correction metrics itself).
  _, met_b, _ = ob.run_objective(
    actor, corr_lib.CorrectionConfig(mode='bypass'), data
  )
  assert any(k.startswith('rollout_corr/') for k in met_b)
  _, met_d, _ = ob.run_objective(actor, corr_lib.CorrectionConfig(), data)
  assert not any(k.startswith('rollout_corr/') for k in met_d)
  # The same config on other data gives the same keys.
  _, met_b2, _ = ob.run_objective(
    actor, corr_lib.CorrectionConfig(mode='bypass'), ob.batch(seed=12)
  )
  assert set(met_b) == set(met_b2)


def test_counts_and_terms_on_corrected_mask():
  """D5: rejected tokens leave every term and both counts."""
  data = ob.batch(seed=13)
  actor = obj_cfg.ActorLossConfig(**ob.ALL_TERMS)
  cc = ob.RS_DECOUPLED
  corr = corr_lib.rollout_correction(
    data['old_logp'], data['rollout_logp'], data['mask'], cc
  )
  _, met, g = ob.run_objective(actor, cc, data, correction=corr)
  m = np.asarray(corr.mask)
  assert float(met['actor/loss_token_count']) == m.sum()
  assert float(met['actor/loss_seq_count']) == m.any(-1).sum()
  ent = np.where(m, data['entropy'], 0).sum() / m.sum()
  assert_close(met['actor/entropy'], ent)
  assert not np.any(g[data['mask'] & ~m])


def _errors_data():
  return ob.batch(seed=14)


def test_mode_mixups_are_errors():
  d = _errors_data()
  actor = obj_cfg.ActorLossConfig()
  lp = d.pop('logp')
  bypass = corr_lib.CorrectionConfig(mode='bypass')
  dec = corr_lib.CorrectionConfig()
  corr = corr_lib.rollout_correction(
    d['old_logp'], d['rollout_logp'], d['mask'], dec
  )
  with pytest.raises(ValueError, match='old_logp must be None in bypass'):
    obj.actor_objective(actor, bypass, logp=lp, **d)
  no_old = {k: v for k, v in d.items() if k != 'old_logp'}
  with pytest.raises(ValueError, match='correction must be None in bypass'):
    obj.actor_objective(actor, bypass, logp=lp, correction=corr, **no_old)
  with pytest.raises(ValueError, match='correction is required in decoupled'):
    obj.actor_objective(actor, dec, logp=lp, **d)
  with pytest.raises(ValueError, match='corr_cfg is None'):
    obj.actor_objective(actor, None, logp=lp, correction=corr, **d)
  no_ro = {k: v for k, v in no_old.items() if k != 'rollout_logp'}
  with pytest.raises(ValueError, match='rollout_logp is required'):
    obj.actor_objective(actor, bypass, logp=lp, **no_ro)


@pytest.mark.parametrize(
  'cfg_kw,drop,match',
  [
    ({}, 'old_logp', 'old_logp is required'),
    ({'entropy_coeff': 0.1}, 'entropy', 'entropy is required'),
    ({'kl_loss_coef': 0.1}, 'ref_logp', 'ref_logp is required'),
    ({'rollout_kl_coef': 0.1}, 'rollout_logp', 'rollout_logp is required'),
    ({'policy_loss': 'prime'}, 'rollout_logp', 'rollout_logp is required'),
  ],
)
def test_missing_arrays_are_errors(cfg_kw, drop, match):
  d = _errors_data()
  lp = d.pop('logp')
  d.pop(drop)
  with pytest.raises(ValueError, match=match):
    obj.actor_objective(obj_cfg.ActorLossConfig(**cfg_kw), None, logp=lp, **d)


def test_trace_time_shape_and_dtype_errors():
  d = _errors_data()
  lp = d.pop('logp')
  actor = obj_cfg.ActorLossConfig()
  with pytest.raises(ValueError, match='bool'):
    obj.actor_objective(
      actor, None, logp=lp, **dict(d, mask=d['mask'].astype(np.float32))
    )
  with pytest.raises(ValueError, match='shape mismatch'):
    obj.actor_objective(
      actor, None, logp=lp, **dict(d, entropy=d['entropy'][:, :3])
    )


def test_objective_checks_combinations_at_trace_time():
  d = _errors_data()
  lp = d.pop('logp')
  d.pop('old_logp')
  pg = corr_lib.CorrectionConfig(mode='bypass', bypass_loss='reinforce')
  with pytest.raises(ValueError, match="policy_loss='vanilla' is not allowed"):
    obj.actor_objective(obj_cfg.ActorLossConfig(), pg, logp=lp, **d)


def test_compatibility_is_checked_once_per_config_pair():
  """A valid (actor, correction) pair is checked when first seen; every later
  trace with it is a cache hit, not a re-check."""
  d = _errors_data()
  lp = d.pop('logp')
  actor = obj_cfg.ActorLossConfig(clip_ratio_low=0.123)  # a pair not seen yet
  loss = jax.jit(
    lambda x, arrays: obj.actor_objective(actor, None, logp=x, **arrays)[0]
  )
  before = obj_cfg.check_compatible.cache_info()
  for n in (2, 3):  # two traces: different batch sizes
    loss(lp[:n], {k: v[:n] for k, v in d.items()})
  after = obj_cfg.check_compatible.cache_info()
  assert after.misses == before.misses + 1
  assert after.hits >= before.hits + 1
