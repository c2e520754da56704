"""`ActorLossConfig`: its knobs match the policy registry, it is hashable and
canonical, validates its fields, and `check_compatible` rules."""

import dataclasses
import math

import jax
import pytest

from jaxcorr.losses import correction as corr_lib
from jaxcorr.losses import objective_config as obj_cfg
from jaxcorr.losses import policy as pol


def test_actor_config_knobs_match_policy_registry():
  knobs = {f.name for f in dataclasses.fields(pol.PolicyKnobs)}
  assert set(pol.KNOB_FIELDS) == knobs
  cfg = obj_cfg.ActorLossConfig()
  for k in knobs:
    assert getattr(cfg, k) == getattr(pol.DEFAULT_KNOBS, k), k
  assert cfg.knobs == pol.DEFAULT_KNOBS
  assert (cfg.entropy_coeff, cfg.kl_loss_coef, cfg.rollout_kl_coef) == (0, 0, 0)
  assert cfg.policy_loss == 'vanilla' and cfg.agg is None


def test_actor_config_is_hashable_and_canonical():
  a = obj_cfg.ActorLossConfig(
    agg='seq-mean-token-mean', kl_loss_type='low_var_kl'
  )
  b = obj_cfg.ActorLossConfig(agg='seq_mean_token_mean', kl_loss_type='k3')
  assert a == b and hash(a) == hash(b)
  assert a.agg == 'seq_mean_token_mean' and a.kl_loss_type == 'k3'
  assert (
    obj_cfg.ActorLossConfig(rollout_kl_type='mse+').rollout_kl_type == 'k2+'
  )
  jax.jit(lambda x, c: x, static_argnums=1)(1.0, a)  # usable as static arg


@pytest.mark.parametrize(
  'kw,match',
  [
    ({'policy_loss': 'ppo'}, r"policy_loss='ppo'.*allowed: cispo"),
    ({'agg': 'mean'}, r"agg='mean'.*allowed: token_mean"),
    ({'kl_loss_type': 'full'}, r"kl_loss_type='full'.*allowed: k1"),
    ({'rollout_kl_type': 'k4'}, r"rollout_kl_type='k4'.*allowed: k1"),
    ({'clip_ratio_c': 1.0}, r'clip_ratio_c=1.0.*allowed: a number > 1'),
    ({'policy_loss': 'dro'}, r'dro_beta=None.*allowed: a number > 0'),
    ({'kl_loss_coef': -0.1}, r'kl_loss_coef=-0.1.*allowed: a finite number'),
    ({'rollout_kl_coef': True}, r'rollout_kl_coef=True.*allowed'),
    ({'entropy_coeff': math.nan}, r'entropy_coeff=nan.*allowed'),
    ({'clip_cov_lb': 6.0}, r'clip_cov_lb.*allowed: clip_cov_lb < clip_cov_ub'),
  ],
)
def test_actor_config_validation(kw, match):
  with pytest.raises(ValueError, match=match):
    obj_cfg.ActorLossConfig(**kw)


def test_check_compatible_rules():
  cc = corr_lib.CorrectionConfig
  check = obj_cfg.check_compatible
  a = obj_cfg.ActorLossConfig
  with pytest.raises(ValueError, match=r"policy_loss='reinforce'.*allowed:"):
    check(a(policy_loss='reinforce'), cc(mode='bypass'))
  with pytest.raises(ValueError, match=r'allowed: reinforce$'):
    check(a(policy_loss='gpg'), cc(mode='bypass', bypass_loss='reinforce'))
  mu_anchored = [n for n, uses in pol.USES_IS_WEIGHTS.items() if not uses]
  assert {'rollout_is', 'prime'} <= set(mu_anchored)
  for name in mu_anchored:
    with pytest.raises(ValueError, match=r"is_level='token'.*is_level=None"):
      check(a(policy_loss=name), cc(is_level='token'))
    check(a(policy_loss=name), cc(mode='bypass'))
  with pytest.raises(ValueError, match='does not report log-probs'):
    check(a(), cc(), rollout_logp_available=False)
  with pytest.raises(ValueError, match=r'rollout_kl_coef=0\.1 needs rollout'):
    check(a(rollout_kl_coef=0.1), None, rollout_logp_available=False)
  with pytest.raises(ValueError, match=r"'rollout_is' reads rollout"):
    check(a(policy_loss='rollout_is'), None, rollout_logp_available=False)
  check(a(), None, rollout_logp_available=False)
  for name in pol.LOSSES:  # decoupled takes any loss
    if name not in (*mu_anchored, 'dro'):
      check(a(policy_loss=name), cc(is_level='token'))
  # Decision: bypass reinforce with no IS, RS or veto is plain REINFORCE.
  check(a(policy_loss='reinforce'), cc(mode='bypass', bypass_loss='reinforce'))
