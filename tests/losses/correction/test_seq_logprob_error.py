"""NeMo-RL's sequence log-prob-error mask as a correction option.

`correction.rs='seq_mean_mpe'` with `rs_bounds=<threshold>` is NeMo-RL's
`grpo.seq_logprob_error_threshold`: the config path equals the standalone
`correction_reject.seq_logprob_error_mask`, composes with other criteria and
the veto, has a fixed metric key set and clear errors, and runs in the
trainer in both modes. NeMo's `null` threshold (metrics only) is a bound no
error reaches (`rs_bounds=1e9`: errors are clamped at e^20 ≈ 4.85e8). The
goldens (`frontier/nemo_rl`) are replayed through both paths in
tests/conformance/frontier_sources/test_nemo_rl.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from jaxcorr.losses import correction as corr
from jaxcorr.losses import objective as obj
from jaxcorr.losses import rewards
from jaxcorr.losses.correction import seq_error
from jaxcorr.losses.objective_config import ActorLossConfig
from jaxcorr.train import build

C = corr.CorrectionConfig
P = 'rollout_corr/rollout_rs_seq_mean_mpe_'
NO_MASK = 1e9
MPE_KEYS = {
  P + k
  for k in (
    'mean',
    'max',
    'min',
    'std',
    'fraction_high',
    'fraction_low',
    'seq_mean',
    'seq_std',
    'seq_max',
    'seq_min',
    'seq_max_deviation',
    'seq_fraction_high',
    'masked_fraction',
    'seq_masked_fraction',
    'kept_seq_mean',
    'kept_seq_max',
    'kept_seq_min',
  )
}


def _cfg(threshold, **kw):
  bound = NO_MASK if threshold is None else threshold
  return C(rs='seq_mean_mpe', rs_bounds=bound, **kw)


def _random(seed, b=9, t=13):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(0, t + 1, b)
  lengths[0] = 0  # an empty row
  mask = np.arange(t)[None] < lengths[:, None]
  train = -rng.uniform(0.01, 3.0, (b, t))
  roll = train + rng.normal(0, 0.3, (b, t))
  roll[1, 0] = train[1, 0] - 30.0  # |Δ| > 20: the clamp (D11)
  reward = rng.choice([0.0, 0.5, 1.0], b)
  return (
    jnp.asarray(train, jnp.float32),
    jnp.asarray(roll, jnp.float32),
    jnp.asarray(mask),
    jnp.asarray(reward, jnp.float32),
  )


@pytest.mark.parametrize('threshold', [None, 1.0, 1.2, 1.5, 3.0])
def test_config_path_equals_standalone(threshold):
  train, roll, mask, reward = _random(1)
  out = corr.rollout_correction(
    train, roll, mask, _cfg(threshold), seq_reward=reward
  )
  ones = jnp.ones(mask.shape[0], bool)
  keep, met = seq_error.seq_logprob_error_mask(
    train, roll, mask, ones, reward, threshold=threshold
  )
  np.testing.assert_array_equal(out.mask, mask & keep[:, None])
  pairs = {
    'seq_max': 'seq_mult_prob_error_max',
    'seq_mean': 'seq_mult_prob_error_mean',
    'seq_min': 'seq_mult_prob_error_min',
    'kept_seq_max': 'seq_mult_prob_error_max_after_mask',
    'kept_seq_mean': 'seq_mult_prob_error_mean_after_mask',
    'kept_seq_min': 'seq_mult_prob_error_min_after_mask',
    'masked_correct_fraction': 'masked_correct_fraction',
  }
  for ours, theirs in pairs.items():
    np.testing.assert_allclose(
      out.metrics[P + ours], met[theirs], rtol=1e-6, err_msg=ours
    )
  # Row 1 carries a |Δ| = 30 token: clamped to e^20, finite.
  assert np.isfinite(float(out.metrics[P + 'seq_max']))
  assert float(out.metrics[P + 'seq_max']) > np.exp(20) / 13


def test_ands_with_other_criteria_and_veto():
  train, roll, mask, reward = _random(2)
  parts = [
    _cfg(1.2),
    C(rs='token_k1', rs_bounds='0.7_1.4'),
    C(veto_low=0.3),
  ]
  both = C(rs='seq_mean_mpe,token_k1', rs_bounds='1.2,0.7_1.4', veto_low=0.3)
  want = np.asarray(mask)
  for cfg in parts:
    want = want & np.asarray(
      corr.rollout_correction(train, roll, mask, cfg).mask
    )
  got = corr.rollout_correction(train, roll, mask, both, seq_reward=reward)
  np.testing.assert_array_equal(got.mask, want)
  assert not np.array_equal(want, np.asarray(mask))  # something was dropped
  alone = corr.rollout_correction(
    train, roll, mask, parts[0], seq_reward=reward
  )
  for k in MPE_KEYS | {P + 'masked_correct_fraction'}:
    np.testing.assert_allclose(got.metrics[k], alone.metrics[k], err_msg=k)


def test_jit_equals_eager():
  train, roll, mask, reward = _random(3)
  cfg = _cfg(1.2, is_level='token')
  eager = corr.rollout_correction(train, roll, mask, cfg, seq_reward=reward)
  jitted = jax.jit(
    lambda a, b, c, d: corr.rollout_correction(a, b, c, cfg, seq_reward=d)
  )(train, roll, mask, reward)
  np.testing.assert_array_equal(eager.mask, jitted.mask)
  np.testing.assert_allclose(eager.weights, jitted.weights, rtol=1e-6)
  assert set(eager.metrics) == set(jitted.metrics)
  for k in eager.metrics:
    np.testing.assert_allclose(
      eager.metrics[k], jitted.metrics[k], rtol=1e-6, atol=1e-7, err_msg=k
    )


def test_metric_key_set_is_fixed_by_the_config():
  cfg = _cfg(1.2)
  keys = []
  for seed in (4, 5):
    train, roll, mask, reward = _random(seed)
    out = corr.rollout_correction(train, roll, mask, cfg, seq_reward=reward)
    keys.append(set(out.metrics))
  assert keys[0] == keys[1]
  mpe = {k for k in keys[0] if k.startswith(P)}
  assert mpe == MPE_KEYS | {P + 'masked_correct_fraction'}
  # Without rewards the masked-correct share is absent (it cannot be known).
  no_reward = corr.rollout_correction(train, roll, mask, cfg)
  assert set(no_reward.metrics) == keys[0] - {P + 'masked_correct_fraction'}
  # Another criterion: no mpe keys, and seq_reward changes nothing.
  k3 = C(rs='seq_mean_k3', rs_bounds=0.01)
  with_r = corr.rollout_correction(train, roll, mask, k3, seq_reward=reward)
  without = corr.rollout_correction(train, roll, mask, k3)
  assert set(with_r.metrics) == set(without.metrics)
  assert not any(k.startswith(P) for k in with_r.metrics)


@pytest.mark.parametrize(
  'bounds, needle',
  [
    (0.5, r'rs_bounds\[seq_mean_mpe\].*up < 1 drops every sequence'),
    ('0.9', r'rs_bounds\[seq_mean_mpe\].*up >= 1'),
    ('0.9_2.0', r"rs_bounds\[seq_mean_mpe\].*'lo_up' string is only for k1"),
    ((1.0, 2.0), r'rs_bounds\[seq_mean_mpe\].*only k1 takes a lower bound'),
    ('inf', r'rs_bounds\[seq_mean_mpe\].*not finite'),
    (True, r'rs_bounds\[seq_mean_mpe\]'),
  ],
)
def test_config_errors_name_the_field_and_allowed_values(bounds, needle):
  with pytest.raises(ValueError, match=needle) as e:
    C(rs='seq_mean_mpe', rs_bounds=(bounds,))
  assert 'allowed: a single number up >= 1' in str(e.value)


def test_unknown_name_lists_the_criterion_and_ml_collections_path():
  with pytest.raises(ValueError, match='seq_mean_mpe') as e:
    C(rs='seq_logprob_error', rs_bounds=2.0)
  assert "unknown criterion 'seq_logprob_error'" in str(e.value)
  cfg = base.get_config()
  cfg.correction.rs = 'seq_mean_mpe'
  cfg.correction.rs_bounds = '2.0'
  assert build.losses(cfg).correction == C(
    rs=('seq_mean_mpe',), rs_bounds=((None, 2.0),)
  )
  cfg.correction.rs_bounds = '0.5'
  with pytest.raises(ValueError, match=r'rs_bounds\[seq_mean_mpe\]'):
    build.losses(cfg)


def test_input_errors():
  train, roll, mask, reward = _random(6)
  with pytest.raises(ValueError, match=r'seq_reward has shape \(8,\)'):
    corr.rollout_correction(train, roll, mask, _cfg(1.2), seq_reward=reward[1:])
  ones = jnp.ones(mask.shape[0], bool)
  with pytest.raises(ValueError, match=r'threshold=0\.5 is invalid'):
    seq_error.seq_logprob_error_mask(
      train, roll, mask, ones, reward, threshold=0.5
    )


def test_bypass_objective_runs_the_criterion_with_rewards():
  """Bypass mode corrects inside the loss: the trainer passes the rows'
  rewards through `actor_objective` (jaxcorr/train/step.py)."""
  train, roll, mask, reward = _random(7)
  cc = _cfg(1.2, mode='bypass')
  adv = jnp.where(mask, 1.0, 0.0)

  def loss(logp, seq_reward=None):
    return obj.actor_objective(
      ActorLossConfig(),
      cc,
      logp=logp,
      advantages=adv,
      mask=mask,
      rollout_logp=roll,
      seq_reward=seq_reward,
    )

  (value, met), grad = jax.value_and_grad(loss, has_aux=True)(train, reward)
  want = corr.rollout_correction(train, roll, mask, cc, seq_reward=reward)
  for k, v in want.metrics.items():
    np.testing.assert_allclose(met[k], v, rtol=1e-6, err_msg=k)
  assert P + 'masked_correct_fraction' in met
  assert P + 'masked_correct_fraction' not in loss(train)[1]
  # A dropped row gets no gradient.
  dropped = np.asarray(mask).any(-1) & ~np.asarray(want.mask).any(-1)
  assert dropped.any()
  assert np.all(np.asarray(grad)[dropped] == 0)
  assert np.isfinite(float(value))


# ------------------------------------------------------------- the trainer


@functools.cache
def _train_step(mode: str):
  """One `Steps.prepare` + `Steps.update` of the tiny arithmetic model with
  the `nemo_seq_logprob_error` preset's criterion (the trainer-step tests'
  batch, tests/helpers/step_batches.py)."""
  from jaxcorr.train import batch as batch_lib
  from jaxcorr.train import build
  from tests.helpers.model_testing import fresh_train_state
  from tests.helpers.step_batches import one_device_mesh, step_arrays
  from tests.helpers.trainer_config import pulse_config

  # The random model is far from the random engine log-probs (row errors
  # 4.2 to 20.7): 6.0 drops three rows of eight, one of them correct.
  c = pulse_config(
    'nemo_seq_logprob_error', correction__mode=mode, correction__rs_bounds='6.0'
  )
  run = build.build(c)
  assert (run.train.mini_batches, run.train.micro_batches) == (1, 1)
  mesh = one_device_mesh()
  state, steps = fresh_train_state(run, mesh)
  with jax.set_mesh(mesh):
    dev = batch_lib.to_device(mesh, step_arrays(run, 1))
    _, arrays, metrics = steps.prepare(
      state.params, None, state.kl_ctrl, None, dev
    )
    if mode == 'bypass':  # decoupled: the correction ran in prepare
      metrics = steps.update(state, arrays)[1]
  return run, jax.device_get(arrays), jax.device_get(metrics)


def test_trainer_runs_the_criterion_with_rewards_in_both_modes():
  """Decoupled: `prepare` corrects the global batch with its rewards.
  Bypass (one mini- and micro-batch, so sg π_θ = π_old at the update):
  the loss corrects with the micro-batch's rewards. Both give the metrics
  of `rollout_correction` on (π_old, μ, rewards)."""
  run, arrays, dec = _train_step('decoupled')
  want = corr.rollout_correction(
    arrays.old_logp,
    arrays.rollout_logp,
    arrays.response_mask,
    run.losses.correction,
    seq_reward=arrays.seq_reward,
  )
  dropped = np.asarray(want.mask).any(-1) < arrays.response_mask.any(-1)
  assert 0 < dropped.sum() < dropped.size  # the mask bites, not everywhere
  np.testing.assert_array_equal(arrays.corr_mask, want.mask)
  _, _, byp = _train_step('bypass')
  key = P + 'masked_correct_fraction'
  correct = np.mean(arrays.seq_reward[dropped] == 1)
  assert 0 < correct < 1
  for got in (dec, byp):
    np.testing.assert_allclose(got[key], correct, rtol=1e-6)
    for k in MPE_KEYS:
      np.testing.assert_allclose(got[k], want.metrics[k], rtol=1e-5, err_msg=k)


def test_d33_dropped_rows_stay_in_the_group_baseline():
  """D33 (docs/correction.md §4): advantages come from the pre-rejection
  mask (D15), so a row the criterion drops still counts in its group's
  baseline; NeMo-RL's advantage stage leaves it out."""
  from jaxcorr.losses import advantages as adv_lib

  run, arrays, _ = _train_step('decoupled')
  mask = jnp.asarray(arrays.response_mask)

  def advantages(m):
    scores = rewards.place_at_last_token(jnp.asarray(arrays.seq_reward), m)
    adv, _ = adv_lib.advantages_from_config(
      run.algorithm.advantage, scores, m, jnp.asarray(arrays.group_ids)
    )
    return np.asarray(adv)

  np.testing.assert_allclose(arrays.advantages, advantages(mask), atol=1e-6)
  nemo = advantages(mask & jnp.asarray(arrays.corr_mask))
  kept = np.asarray(arrays.corr_mask)
  assert not np.allclose(np.where(kept, arrays.advantages, 0), nemo)


def test_d31_error_is_clamped_where_nemo_overflows():
  """D31: |Δ| = 100 at one token; NeMo's exp(|Δ|) is inf in float32."""
  train = jnp.zeros((2, 4), jnp.float32).at[0, 1].set(-100.0)
  roll = jnp.zeros((2, 4), jnp.float32)
  mask = jnp.ones((2, 4), bool)
  with np.errstate(over='ignore'):
    assert np.isinf(np.exp(np.float32(100.0)))  # NeMo's token error
  out = corr.rollout_correction(train, roll, mask, _cfg(2.0))
  want = (np.exp(np.float32(20.0)) + 3) / 4
  np.testing.assert_allclose(out.metrics[P + 'seq_max'], want, rtol=1e-6)
  np.testing.assert_array_equal(out.mask, [[False] * 4, [True] * 4])


def test_d32_threshold_below_one_is_a_config_error():
  """D32: every error is ≥ 1; NeMo-RL would silently drop every row."""
  with pytest.raises(ValueError, match=r'rs_bounds\[seq_mean_mpe\]'):
    C(rs='seq_mean_mpe', rs_bounds=0.99)
  assert C(rs='seq_mean_mpe', rs_bounds=1.0).rs_bounds == ((None, 1.0),)
