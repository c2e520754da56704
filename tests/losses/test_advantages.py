"""Properties of the advantage estimators, KL in reward and controllers.

Random batches (hypothesis) with singleton groups, all-equal rewards, empty
rows, tool-output holes, left- and right-aligned responses, non-adjacent and
unsorted group ids, and NaN/±inf in the padding. Checked for every estimator:

* finite outputs, exactly 0 outside the mask, bitwise equal to the same
  batch with zeros in the padding;
* permuting the rows (with their group ids) permutes the outputs;
* the layout does not matter: left/right alignment and holes give the
  values of the compacted response;
* grpo has mean 0 within every group of ≥ 2 valid members;
* jit == eager, one compilation per shape, 8-device sharding == 1 device,
  no gradient;

plus KL-in-reward and controller properties, reward placement, and every
configuration / trace-time validation error.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.serialization
import hypothesis as hp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from absl import flags as absl_flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from ml_collections import config_flags

from configs import algorithm as algo_section
from configs import base
from jaxcorr.config import fields
from jaxcorr.losses import advantages as adv_lib
from jaxcorr.losses import kl as kl_lib
from jaxcorr.losses import rewards as rw
from jaxcorr.train import build
from jaxcorr.train.run_config import AlgorithmConfig

B, T = 8, 12
ESTIMATORS = adv_lib.ESTIMATORS
AC = adv_lib.AdvantageConfig
KC = rw.KLControlConfig

settings = functools.partial(
  hp.settings,
  deadline=None,
  suppress_health_check=[hp.HealthCheck.too_slow],
)


@functools.cache
def jitted():
  return jax.jit(
    adv_lib.compute_advantages,
    static_argnames=('estimator', 'norm_adv_by_std'),
  )


# ---------------------------------------------------------------- batches


def _groups(rng, b) -> np.ndarray:
  """Random partition of the rows into groups (singletons included), ids
  scattered over the batch: label = a random member's index."""
  perm = rng.permutation(b)
  cuts = np.sort(rng.choice(np.arange(1, b), rng.integers(0, b), False))
  ids = np.zeros(b, np.int32)
  for part in np.split(perm, cuts):
    ids[part] = rng.choice(part)
  return ids


def _mask(rng, b, t, *, right, holes, empty) -> np.ndarray:
  lengths = rng.integers(0 if empty else 1, t + 1, b)
  lengths[0] = max(lengths[0], 2)  # at least one long-enough row
  pos = np.arange(t)[None, :]
  if right:
    mask = pos >= (t - lengths)[:, None]
  else:
    mask = pos < lengths[:, None]
  if holes:
    for i in np.nonzero(lengths >= 4)[0]:
      if rng.random() < 0.5:
        idx = np.nonzero(mask[i])[0]
        a = rng.integers(1, len(idx) - 2)
        mask[i, idx[a : a + rng.integers(1, len(idx) - a - 1)]] = False
  return mask


def _last(mask) -> np.ndarray:
  t = mask.shape[1]
  return np.where(mask.any(-1), t - 1 - np.argmax(mask[:, ::-1], -1), -1)


def make_batch(seed, b=B, t=T, **kw) -> dict:
  """A random batch; keyword flags: right, holes, empty, equal, process."""
  rng = np.random.default_rng(seed)
  mask = _mask(
    rng,
    b,
    t,
    right=kw.get('right', False),
    holes=kw.get('holes', True),
    empty=kw.get('empty', True),
  )
  seq = rng.choice([0.0, 0.25, 1.0, -0.5], b).astype(np.float32)
  if kw.get('equal'):
    seq[:] = seq[0]
  rewards = np.zeros((b, t), np.float32)
  rows = np.nonzero(mask.any(-1))[0]
  rewards[rows, _last(mask)[rows]] = seq[rows]
  if kw.get('process'):
    rewards += np.where(mask, rng.normal(0, 0.1, (b, t)), 0).astype(np.float32)
  return {
    'token_rewards': rewards,
    'mask': mask,
    'group_ids': _groups(rng, b),
    'values': rng.normal(0, 1, (b, t)).astype(np.float32),
    'reward_baselines': rng.normal(0.5, 0.3, b).astype(np.float32),
  }


def dirty(batch: dict, fill: float) -> dict:
  """The batch with `fill` in every masked position of every input."""
  m = batch['mask']
  out = dict(batch)
  for k in ('token_rewards', 'values'):
    out[k] = np.where(m, batch[k], fill).astype(np.float32)
  out['reward_baselines'] = np.where(
    m.any(-1), batch['reward_baselines'], fill
  ).astype(np.float32)
  return out


def run(est, batch, fn=None, norm=True, gamma=0.95, lam=0.9):
  fn = fn or jitted()
  a, r = fn(
    est,
    batch['token_rewards'],
    batch['mask'],
    batch['group_ids'],
    values=batch['values'],
    gamma=gamma,
    lam=lam,
    norm_adv_by_std=norm,
    reward_baselines=batch['reward_baselines'],
  )
  return np.asarray(a), np.asarray(r)


flags = st.fixed_dictionaries(
  {
    'right': st.booleans(),
    'holes': st.booleans(),
    'empty': st.booleans(),
    'equal': st.booleans(),
    'process': st.booleans(),
  }
)
seeds = st.integers(0, 2**32 - 1)


# ------------------------------------------------------------ robustness


@settings(max_examples=8)
@hp.given(
  seed=seeds, kw=flags, fill=st.sampled_from([np.nan, np.inf, -np.inf, 1e30])
)
def test_finite_zero_outside_and_padding_invariant(seed, kw, fill):
  batch = make_batch(seed, **kw)
  m = batch['mask']
  for est in ESTIMATORS:
    for norm in (True, False):
      clean = run(est, batch, norm=norm)
      junk = run(est, dirty(batch, fill), norm=norm)
      for x, y in zip(clean, junk):
        assert np.isfinite(x).all(), est
        assert (x[~m] == 0).all(), est
        np.testing.assert_array_equal(x, y, err_msg=est)


@settings(max_examples=8)
@hp.given(seed=seeds, kw=flags, perm_seed=seeds)
def test_permuting_rows_permutes_outputs(seed, kw, perm_seed):
  batch = make_batch(seed, **kw)
  perm = np.random.default_rng(perm_seed).permutation(B)
  moved = {k: v[perm] for k, v in batch.items()}
  for est in ESTIMATORS:
    a, r = run(est, batch)
    pa, pr = run(est, moved)
    np.testing.assert_allclose(pa, a[perm], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pr, r[perm], rtol=1e-5, atol=1e-6)


@settings(max_examples=10)
@hp.given(seed=seeds, kw=flags)
def test_grpo_mean_zero_within_groups(seed, kw):
  batch = make_batch(seed, **kw)
  m, ids = batch['mask'], batch['group_ids']
  valid = m.any(-1)
  last = _last(m)
  for norm in (True, False):
    a, r = run('grpo', batch, norm=norm)
    np.testing.assert_array_equal(a, r)
    seq = np.where(valid, a[np.arange(B), last], 0)
    for g in np.unique(ids):
      members = (ids == g) & valid
      if members.sum() >= 2:
        assert abs(seq[members].mean()) < 1e-5
      elif members.sum() == 1:
        (i,) = np.nonzero(members)[0]
        s = batch['token_rewards'][i][m[i]].sum()
        want = s / (1 + 1e-6) if norm else s
        np.testing.assert_allclose(seq[i], want, rtol=1e-6, atol=1e-7)


def _relayout(batch, rng, right, holes):
  """The same responses at another alignment, with holes (junk inside)."""
  m = batch['mask']
  b, t = m.shape
  t2 = t + 6
  out = {
    'token_rewards': np.full((b, t2), np.nan, np.float32),
    'values': np.full((b, t2), np.inf, np.float32),
    'mask': np.zeros((b, t2), bool),
    'group_ids': batch['group_ids'],
    'reward_baselines': batch['reward_baselines'],
  }
  where = []
  for i in range(b):
    idx = np.nonzero(m[i])[0]
    n = len(idx)
    gaps = np.zeros(n, int)
    if holes and n > 1:
      gaps[rng.integers(1, n)] = rng.integers(1, 4)
    pos = np.arange(n) + np.cumsum(gaps)
    if right and n:
      pos = pos + (t2 - 1 - pos[-1])
    out['mask'][i, pos] = True
    out['token_rewards'][i, pos] = batch['token_rewards'][i, idx]
    out['values'][i, pos] = batch['values'][i, idx]
    where.append((idx, pos))
  return out, where


@settings(max_examples=6)
@hp.given(seed=seeds, kw=flags, right=st.booleans(), holes=st.booleans())
def test_layout_and_holes_do_not_matter(seed, kw, right, holes):
  """GAE and REINFORCE++ skip padding and holes: only valid tokens count."""
  batch = make_batch(seed, **kw)
  other, where = _relayout(batch, np.random.default_rng(seed), right, holes)
  for est in ESTIMATORS:
    a, r = run(est, batch)
    a2, r2 = run(est, other)
    for i, (idx, pos) in enumerate(where):
      np.testing.assert_allclose(a2[i, pos], a[i, idx], rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(r2[i, pos], r[i, idx], rtol=1e-5, atol=1e-6)


def test_empty_batch_and_all_equal_rewards():
  m = np.zeros((3, 4), bool)
  x = np.full((3, 4), np.nan, np.float32)
  ids = np.zeros(3, np.int32)
  for est in ESTIMATORS:
    a, r = adv_lib.compute_advantages(
      est, x, m, ids, values=x, reward_baselines=x[:, 0]
    )
    np.testing.assert_array_equal(np.asarray(a), 0.0)
    np.testing.assert_array_equal(np.asarray(r), 0.0)
  m = np.ones((4, 3), bool)
  r = np.zeros((4, 3), np.float32)
  r[:, -1] = 0.7
  for est in ('grpo', 'rloo', 'opo', 'gpg', 'grpo_passk', 'maxrl'):
    a, _ = adv_lib.compute_advantages(est, r, m, np.zeros(4, np.int32))
    np.testing.assert_allclose(np.asarray(a), 0.0, atol=1e-6, err_msg=est)


@pytest.mark.parametrize(
  'estimator, norm',
  [
    ('grpo', True),
    ('grpo', False),
    ('reinforce_plus_plus', True),
    ('gae', True),
  ],
)
def test_large_finite_rewards_keep_finite_signed_advantages(estimator, norm):
  """Rewards of ±1e30 are finite in float32 but their squared deviations
  are not: the group std (grpo) and the whitening variance (gae,
  reinforce++) must not overflow to inf and zero every advantage. Each
  advantage is the one of rewards ±1 scaled as the estimator scales."""
  m = np.ones((6, 3), bool)
  m[4:, 2] = False  # shorter rows: the reward sits on another token
  sign = np.array([1, -1, 1, -1, 1, -1], np.float32)
  small = np.zeros((6, 3), np.float32)
  small[np.arange(6), np.where(m[:, 2], 2, 1)] = sign
  ids = np.array([0, 0, 0, 0, 1, 1], np.int32)
  values = np.zeros((6, 3), np.float32)

  def adv(r):
    a, _ = jitted()(estimator, r, m, ids, values=values, norm_adv_by_std=norm)
    return np.asarray(a)

  big, ref = adv(small * np.float32(1e30)), adv(small)
  assert np.isfinite(big).all()
  np.testing.assert_array_equal(np.sign(big), np.sign(ref))
  assert (np.sign(ref[m]) != 0).any()
  # Normalised estimators are scale-free (eps aside); grpo without the std
  # is linear in the rewards.
  want = ref * np.float32(1e30) if estimator == 'grpo' and not norm else ref
  np.testing.assert_allclose(big, want, rtol=2e-5)


# --------------------------------------------------- jit, compile, shard


def test_jit_matches_eager():
  batch = make_batch(3, process=True)
  for est in ESTIMATORS:
    for norm in (True, False):
      got = run(est, batch, norm=norm)
      want = run(est, batch, fn=adv_lib.compute_advantages, norm=norm)
      for x, y in zip(got, want):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6, err_msg=est)


def test_compiles_once_per_shape():
  traces = []

  @functools.partial(jax.jit, static_argnames='est')
  def fn(est, rewards, mask, ids, values, gamma, beta):
    traces.append((est, rewards.shape))
    a, _ = adv_lib.compute_advantages(
      est, rewards, mask, ids, values=values, gamma=gamma, lam=gamma
    )
    return a * beta

  for seed in range(3):
    b = make_batch(seed)
    args = (b['token_rewards'], b['mask'], b['group_ids'], b['values'])
    for gamma in (1.0, 0.9):  # γ and β are traced: no recompilation
      jax.block_until_ready(fn('gae', *args, gamma, 0.1 * seed))
      jax.block_until_ready(fn('grpo', *args, gamma, 1.0))
  assert traces == [('gae', (B, T)), ('grpo', (B, T))]
  b = make_batch(0, b=4, t=6)
  args = (b['token_rewards'], b['mask'], b['group_ids'], b['values'])
  jax.block_until_ready(fn('gae', *args, 1.0, 1.0))
  assert traces[-1] == ('gae', (4, 6)) and len(traces) == 3


def test_jaxpr_has_no_callbacks_or_python_loops_over_groups():
  spec = jax.ShapeDtypeStruct((B, T), jnp.float32)
  mask = jax.ShapeDtypeStruct((B, T), jnp.bool_)
  ids = jax.ShapeDtypeStruct((B,), jnp.int32)
  for est in ESTIMATORS:
    fn = functools.partial(adv_lib.compute_advantages, est)
    text = str(
      jax.make_jaxpr(
        lambda r, m, i, v, fn=fn: fn(
          r, m, i, values=v, reward_baselines=v[:, 0]
        )
      )(spec, mask, ids, spec)
    )
    assert 'callback' not in text
    if est in adv_lib.NEEDS_GROUPS:
      assert 'scatter-add' in text or 'scatter_add' in text  # segment_sum
    else:
      assert 'scan' in text


MESHES = {
  # jax.make_mesh's default: explicit axes; the batch over both axes.
  'explicit_4x2': lambda: jax.make_mesh((4, 2), ('data', 'fsdp')),
  'auto_8': lambda: jax.make_mesh(
    (8,), ('data',), axis_types=(jax.sharding.AxisType.Auto,)
  ),
}


@pytest.mark.parametrize('mesh_name', sorted(MESHES))
@settings(max_examples=1)
@hp.given(seed=seeds, kw=flags)
def test_sharded_batch_matches_single_device(mesh_name, seed, kw):
  """Batch rows sharded over the 8 fake devices == one device."""
  assert jax.device_count() == 8
  mesh = MESHES[mesh_name]()
  axes = mesh.axis_names
  rows, vec = NamedSharding(mesh, P(axes, None)), NamedSharding(mesh, P(axes))
  batch = make_batch(seed, b=16, t=T, **kw)
  sharded = {
    k: jax.device_put(v, rows if v.ndim == 2 else vec) for k, v in batch.items()
  }
  assert sharded['mask'].sharding.shard_shape((16, T)) == (2, T)
  for est in ESTIMATORS:
    single = run(est, batch)
    multi = run(est, sharded)
    for x, y in zip(multi, single):
      np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6, err_msg=est)
  # Placement and KL in reward on the same sharded rows.
  seq = jax.device_put(batch['reward_baselines'], vec)
  placed = jax.jit(rw.place_at_last_token)
  np.testing.assert_array_equal(
    np.asarray(placed(seq, sharded['mask'])),
    np.asarray(placed(batch['reward_baselines'], batch['mask'])),
  )
  kl_fn = jax.jit(rw.apply_kl_penalty)
  args = ('token_rewards', 'values', 'token_rewards', 'mask')
  one = kl_fn(*(batch[k] for k in args), 0.1)
  many = kl_fn(*(sharded[k] for k in args), 0.1)
  for x, y in zip(jax.tree.leaves(many), jax.tree.leaves(one)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)


def test_no_gradient_flows():
  batch = make_batch(5, process=True)

  def total(rewards, values, est):
    a, r = adv_lib.compute_advantages(
      est,
      rewards,
      batch['mask'],
      batch['group_ids'],
      values=values,
      reward_baselines=batch['reward_baselines'],
    )
    return jnp.sum(a * 1.3 + r)

  for est in ESTIMATORS:
    g = jax.grad(total, argnums=(0, 1))(
      batch['token_rewards'], batch['values'], est
    )
    for x in g:
      np.testing.assert_array_equal(np.asarray(x), 0.0)


def test_dtypes():
  spec = functools.partial(jax.ShapeDtypeStruct, (2, 3))
  mask, ids = spec(jnp.bool_), jax.ShapeDtypeStruct((2,), jnp.int32)
  for est in ('grpo', 'gae'):
    out = jax.eval_shape(
      functools.partial(adv_lib.compute_advantages, est),
      spec(jnp.bfloat16),
      mask,
      ids,
      values=spec(jnp.bfloat16),
    )
    assert all(x.dtype == jnp.float32 for x in out)
    with jax.enable_x64(True):
      out = jax.eval_shape(
        functools.partial(adv_lib.compute_advantages, est),
        spec(jnp.float64),
        mask,
        ids,
        values=spec(jnp.float32),
      )
      assert all(x.dtype == jnp.float64 for x in out)


# ---------------------------------------------------- reward placement


@settings(max_examples=10)
@hp.given(seed=seeds, right=st.booleans(), holes=st.booleans())
def test_place_at_last_token(seed, right, holes):
  rng = np.random.default_rng(seed)
  m = _mask(rng, B, T, right=right, holes=holes, empty=True)
  r = rng.normal(size=B).astype(np.float32)
  r[~m.any(-1)] = np.nan  # dropped with its empty row
  out = np.asarray(rw.place_at_last_token(r, m))
  last = _last(m)
  for i in range(B):
    row = np.zeros(T, np.float32)
    if last[i] >= 0:
      row[last[i]] = r[i]
      assert m[i, last[i]] and not m[i, last[i] + 1 :].any()
    np.testing.assert_array_equal(out[i], row)


# -------------------------------------------------------- KL in reward


@pytest.mark.parametrize('estimator', kl_lib.valid_names())
def test_kl_in_reward_with_zero_coef_keeps_scores(estimator):
  batch = make_batch(7)
  m = batch['mask']
  rng = np.random.default_rng(7)
  old = rng.normal(-1, 0.3, (B, T)).astype(np.float32)
  ref = (old + rng.normal(0, 0.2, (B, T))).astype(np.float32)
  old[~m] = np.nan
  scores = batch['token_rewards']
  copies = [x.copy() for x in (scores, old, ref)]
  rewards, kl, met = rw.apply_kl_penalty(
    scores, old, ref, m, 0.0, estimator=estimator
  )
  for x, y in zip((scores, old, ref), copies):
    np.testing.assert_array_equal(x, y)  # inputs untouched
  np.testing.assert_array_equal(np.asarray(rewards), scores)
  want = kl_lib.kl_penalty(old, ref, estimator, mask=m)
  np.testing.assert_array_equal(np.asarray(kl), np.asarray(want))
  assert (np.asarray(kl)[m] != 0).all() and (np.asarray(kl)[~m] == 0).all()
  assert rewards is not kl
  assert float(met[rw.KL_COEF_METRIC]) == 0.0
  rows = m.any(-1)
  per_row = np.asarray(kl).sum(-1)[rows] / m.sum(-1)[rows]
  np.testing.assert_allclose(
    float(met[rw.KL_METRIC]), per_row.mean(), rtol=1e-5, atol=1e-7
  )


def test_kl_in_reward_shapes_and_traced_coef_does_not_recompile():
  batch = make_batch(8)
  m = batch['mask']
  rng = np.random.default_rng(8)
  old = rng.normal(-1, 0.3, (B, T)).astype(np.float32)
  ref = (old + rng.normal(0, 0.2, (B, T))).astype(np.float32)
  traces = []

  @jax.jit
  def step(coef):
    traces.append(1)
    return rw.apply_kl_penalty(batch['token_rewards'], old, ref, m, coef)

  for coef in (0.0, 0.05, 0.2):
    rewards, kl, met = step(jnp.float32(coef))
    want = np.where(m, batch['token_rewards'] - np.float32(coef) * kl, 0)
    np.testing.assert_allclose(np.asarray(rewards), want, rtol=1e-6)
    assert float(met[rw.KL_COEF_METRIC]) == pytest.approx(coef)
  assert len(traces) == 1


def test_adaptive_controller_matches_verl_over_three_steps():
  cfg = KC(type='adaptive', kl_coef=0.05, target_kl=0.1, horizon=100)
  state = rw.init_kl_controller(cfg)
  update = jax.jit(rw.update_kl_controller, static_argnums=3)
  coef = 0.05
  for current in (0.3, 0.02, 0.11):
    state = update(state, jnp.float32(current), 16, cfg)
    coef *= 1 + np.clip(current / 0.1 - 1, -0.2, 0.2) * 16 / 100
    assert float(state.coef) == pytest.approx(coef, rel=1e-6)
  fixed = KC(kl_coef=0.3)
  s = rw.init_kl_controller(fixed)
  assert rw.update_kl_controller(s, 5.0, 8, fixed) is s


def test_controller_state_is_a_checkpointable_pytree():
  state = rw.init_kl_controller(KC(type='adaptive', kl_coef=0.02))
  (leaf,) = jax.tree.leaves(state)
  assert leaf.dtype == jnp.float32 and leaf.shape == ()
  raw = flax.serialization.to_bytes(state)
  blank = rw.KLControllerState(coef=jnp.zeros((), jnp.float32))
  restored = flax.serialization.from_bytes(blank, raw)
  assert float(restored.coef) == pytest.approx(0.02)
  doubled = jax.tree.map(lambda x: 2 * x, state)
  assert isinstance(doubled, rw.KLControllerState)


# ------------------------------------------------------------ validation


@pytest.mark.parametrize(
  'kwargs, match',
  [
    ({'estimator': 'ppo'}, r'AdvantageConfig.estimator.*gae, grpo'),
    ({'estimator': None}, 'AdvantageConfig.estimator'),
    ({'gamma': 1.5}, r'AdvantageConfig.gamma.*\[0, 1\]'),
    ({'gamma': '0.9'}, 'AdvantageConfig.gamma.*not a number'),
    ({'lam': -0.1}, 'AdvantageConfig.lam'),
    ({'norm_adv_by_std': 1}, 'AdvantageConfig.norm_adv_by_std.*True or False'),
    ({'eps': -1e-6}, 'AdvantageConfig.eps.*>= 0'),
    ({'eps': float('nan')}, 'AdvantageConfig.eps'),
  ],
)
def test_advantage_config_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    AC(**kwargs)


def test_advantage_config_is_hashable_with_defaults():
  cfg = AC()
  assert cfg.estimator == 'grpo' and cfg.gamma == 1.0 and hash(cfg)
  assert AC(gamma=1) == AC(gamma=1.0)
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.gamma = 0.5  # type: ignore[misc]


@pytest.mark.parametrize(
  'kwargs, match',
  [
    ({'type': 'pid'}, r"KLControlConfig.type.*'fixed', 'adaptive'"),
    ({'kl_coef': -0.1}, r'KLControlConfig.kl_coef.*>= 0'),
    ({'type': 'adaptive', 'target_kl': 0.0}, 'KLControlConfig.target_kl.*> 0'),
    ({'type': 'adaptive', 'horizon': 0}, 'KLControlConfig.horizon.*> 0'),
    ({'horizon': True}, 'KLControlConfig.horizon'),
  ],
)
def test_kl_control_config_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    KC(**kwargs)


def test_compute_advantages_trace_time_errors():
  b = make_batch(1)
  r, m, ids, v = b['token_rewards'], b['mask'], b['group_ids'], b['values']
  f = adv_lib.compute_advantages
  with pytest.raises(ValueError, match=r"estimator='ppo'.*allowed: gae"):
    f('ppo', r, m, ids)
  with pytest.raises(ValueError, match="values is required by estimator='gae'"):
    f('gae', r, m, None)
  with pytest.raises(ValueError, match='reward_baselines is required'):
    f('remax', r, m, None)
  with pytest.raises(ValueError, match=r'reward_baselines must have shape'):
    f('remax', r, m, None, reward_baselines=np.zeros(3, np.float32))
  with pytest.raises(
    ValueError, match="group_ids is required by estimator='grpo'"
  ):
    f('grpo', r, m, None)
  with pytest.raises(ValueError, match='integer dtype'):
    f('grpo', r, m, ids.astype(np.float32))
  with pytest.raises(ValueError, match='bool'):
    f('grpo', r, m.astype(np.float32), ids)
  with pytest.raises(ValueError, match='shape mismatch'):
    f('gae', r, m, None, values=v[:, :-1])
  with pytest.raises(ValueError, match='norm_adv_by_std'):
    f('grpo', r, m, ids, norm_adv_by_std=1)
  with pytest.raises(ValueError, match=r'gamma=1.5.*\[0, 1\]'):
    f('reinforce_plus_plus', r, m, None, gamma=1.5)
  for est in ('gae', 'reinforce_plus_plus', 'remax'):  # group_ids optional
    f(est, r, m, None, values=v, reward_baselines=v[:, 0])
  with pytest.raises(ValueError, match='seq_rewards'):
    rw.place_at_last_token(np.zeros(3, np.float32), m)
  with pytest.raises(ValueError, match='not a KL estimator'):
    rw.apply_kl_penalty(r, v, v, m, 0.1, estimator='k9')
  with pytest.raises(ValueError, match='kl_coef'):
    rw.apply_kl_penalty(r, v, v, m, -0.1)


# ------------------------------------------------------- config section


def _section(**over):
  cd = ml_collections.ConfigDict(
    {'algorithm': algo_section.algorithm_section()}
  )
  for path, value in over.items():
    node = cd.algorithm
    *parents, leaf = path.split('__')
    for p in parents:
      node = node[p]
    node[leaf] = value
  return cd


def test_algorithm_section_defaults_build():
  built = build.algorithm(_section())
  assert built == AlgorithmConfig()
  assert built.advantage == AC() and built.kl_in_reward is None
  assert built.kl_penalty == 'k1'
  cd = _section(
    estimator='gae',
    gamma=0.99,
    lam=0.95,
    kl_penalty='low_var_kl+',
    kl_in_reward__enabled=True,
    kl_in_reward__type='adaptive',
  )
  built = build.algorithm(cd)
  assert built.advantage == AC(estimator='gae', gamma=0.99, lam=0.95)
  assert built.kl_in_reward == KC(type='adaptive')
  assert built.kl_penalty == 'k3+'
  assert build.algorithm(cd.algorithm) == built  # the section alone
  assert hash(built)


@pytest.mark.parametrize(
  'over, match',
  [
    ({'estimator': 'ppo'}, r'config\.algorithm\.estimator.*allowed: gae'),
    ({'gamma': 2.0}, r'config\.algorithm\.gamma.*\[0, 1\]'),
    ({'lam': -1.0}, r'config\.algorithm\.lam'),
    ({'eps': -1.0}, r'config\.algorithm\.eps'),
    ({'kl_penalty': 'k5'}, r'config\.algorithm\.kl_penalty.*allowed: k1'),
    (
      {'kl_in_reward__enabled': True, 'kl_in_reward__kl_coef': -1.0},
      r'config\.algorithm\.kl_in_reward\.kl_coef.*>= 0',
    ),
    (
      {'kl_in_reward__enabled': True, 'kl_in_reward__type': 'pid'},
      r"config\.algorithm\.kl_in_reward\.type.*'fixed', 'adaptive'",
    ),
    (
      {
        'kl_in_reward__enabled': True,
        'kl_in_reward__type': 'adaptive',
        'kl_in_reward__horizon': 0,
      },
      r'config\.algorithm\.kl_in_reward\.horizon',
    ),
  ],
)
def test_algorithm_section_errors_name_the_field(over, match):
  with pytest.raises(ValueError, match=match):
    build.algorithm(_section(**over))


def test_algorithm_converter_rejects_unknown_fields():
  values = _section().algorithm.to_dict()
  values['gama'] = 0.9
  with pytest.raises(ValueError, match=r'config\.algorithm.*unknown.*gama'):
    build.algorithm(values)
  values = _section().algorithm.to_dict()
  values['kl_in_reward']['coef'] = 0.1
  with pytest.raises(ValueError, match=r'kl_in_reward.*unknown.*coef'):
    build.algorithm(values)
  values = _section().algorithm.to_dict()
  values['kl_in_reward']['enabled'] = 'yes'
  with pytest.raises(ValueError, match=r'kl_in_reward\.enabled.*True, False'):
    build.algorithm(values)


def test_startup_checks():
  passk = build.algorithm(_section(estimator='grpo_passk'))
  with pytest.raises(ValueError, match=r'estimator.*samples_per_prompt >= 2'):
    build.check_startup(passk, batch_size=8, samples_per_prompt=1)
  build.check_startup(passk, batch_size=8, samples_per_prompt=2)
  adaptive = build.algorithm(
    _section(
      kl_in_reward__enabled=True,
      kl_in_reward__type='adaptive',
      kl_in_reward__horizon=100,
    )
  )
  with pytest.raises(ValueError, match=r'kl_in_reward\.horizon.*> 100'):
    build.check_startup(adaptive, batch_size=500, samples_per_prompt=4)
  build.check_startup(adaptive, batch_size=499, samples_per_prompt=4)


def test_section_fields_cover_the_dataclasses_and_are_commented():
  cd = algo_section.algorithm_section()
  adv_fields = {f.name for f in dataclasses.fields(AC)}
  assert set(cd) == adv_fields | {'kl_penalty', 'kl_in_reward'}
  kl_fields = {f.name for f in dataclasses.fields(KC)}
  assert set(cd.kl_in_reward) == kl_fields | {'enabled'}
  # Each field's doc is declared once, on its dataclass.
  documented = {
    **fields.docs(AC),
    **fields.docs(KC),
    'kl_penalty': fields.docs(AlgorithmConfig)['kl_penalty'],
  }
  assert set(documented) == (set(cd) - {'kl_in_reward'}) | kl_fields
  for name, doc in documented.items():
    assert len(doc) > 10, name


def test_base_config_carries_the_algorithm_section():
  assert build.algorithm(base.get_config()) == (AlgorithmConfig())
  argv = [
    'prog',
    f'--config={base.__file__}',
    '--config.algorithm.estimator=gae',
    '--config.algorithm.lam=0.95',
    '--config.algorithm.kl_penalty=low_var_kl',
    '--config.algorithm.kl_in_reward.enabled=true',
    '--config.algorithm.kl_in_reward.type=adaptive',
    '--config.algorithm.kl_in_reward.horizon=500',
  ]
  fv = absl_flags.FlagValues()
  config_flags.DEFINE_config_file('config', flag_values=fv, sys_argv=argv)
  fv(argv)
  built = build.algorithm(fv.config)
  assert built.advantage == AC(estimator='gae', lam=0.95)
  assert built.kl_in_reward == KC(type='adaptive', horizon=500)
  assert built.kl_penalty == 'k3'


def test_advantages_from_config_passes_every_knob():
  batch = make_batch(11, process=True)
  for cfg in (
    AC(estimator='gae', gamma=0.9, lam=0.8),
    AC(estimator='grpo', norm_adv_by_std=False),
    AC(estimator='maxrl', eps=0.0),
  ):
    got = adv_lib.advantages_from_config(
      cfg,
      batch['token_rewards'],
      batch['mask'],
      batch['group_ids'],
      values=batch['values'],
    )
    want = adv_lib.compute_advantages(
      cfg.estimator,
      batch['token_rewards'],
      batch['mask'],
      batch['group_ids'],
      values=batch['values'],
      gamma=cfg.gamma,
      lam=cfg.lam,
      norm_adv_by_std=cfg.norm_adv_by_std,
      eps=cfg.eps,
    )
    for x, y in zip(got, want):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
