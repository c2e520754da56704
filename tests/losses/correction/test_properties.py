"""Properties, invariances, JAX contract and config validation of the rollout
correction (docs/math/correction.md §3, §8, §9).

Compilation is the cost on CPU, so shape-varying checks use four fixed
configurations (together: every IS level and mode, all 11 RS criteria, both
vetoes, batch normalisation) jitted once per shape, and config-varying checks
draw configurations freely and run the eager path at one fixed shape.
"""

from __future__ import annotations

import functools
import math

import hypothesis as hp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcorr.losses import correction as corr
from jaxcorr.losses import masked
from jaxcorr.losses.correction import config as corr_config
from jaxcorr.losses.correction import rejection

CC = corr.CorrectionConfig
PREFIX = corr.METRIC_PREFIX

CONFIGS = {
  'token_bn_rs_veto': CC(
    is_level='token',
    is_batch_normalize=True,
    rs=('token_k1', 'seq_max_k3'),
    rs_bounds=('0.5_2.0', 0.5),
    veto_low=1e-4,
    veto_high=1e4,
  ),
  'seq_clip_rs': CC(
    mode='bypass',
    bypass_loss='reinforce',
    is_level='sequence',
    is_mode='clip',
    is_lower=0.5,
    is_upper=5.0,
    rs=('seq_sum_k1', 'seq_mean_k2', 'token_k3'),
    rs_bounds=((0.1, 10.0), 2.0, 5.0),
    veto_low=1e-6,
  ),
  'geo_mask_bn_rs': CC(
    is_level='geometric',
    is_mode='mask',
    is_upper=3.0,
    is_batch_normalize=True,
    rs=(
      'seq_mean_k1',
      'seq_sum_k2',
      'seq_sum_k3',
      'seq_mean_k3',
      'seq_max_k2',
      'token_k2',
    ),
    rs_bounds=('0.2_5.0', 50.0, 50.0, 2.0, 8.0, 8.0),
  ),
  'kpop_rs': CC(
    is_level='token',
    is_mode='clip',
    rs=(
      'token_bkl',
      'seq_sum_bkl',
      'seq_mean_bkl',
      'seq_max_bkl',
      'seq_mean_mpe',
    ),
    rs_bounds=(0.5, 20.0, 1.0, 2.0, 1.5),
  ),
  'metrics_only': CC(),
}
SHAPES = ((1, 1), (8, 7))  # (8, 7) also serves the 8-device sharding test
EAGER_SHAPE = (8, 32)  # the golden batches' shape: eager caches are warm
GARBAGE = (np.nan, np.inf, -np.inf, 1e30, -1e30)

settings = functools.partial(
  hp.settings,
  deadline=None,
  suppress_health_check=[hp.HealthCheck.too_slow],
)

jitted = jax.jit(corr.rollout_correction, static_argnames='cfg')


def test_configs_cover_every_feature():
  cfgs = CONFIGS.values()
  assert {c.is_level for c in cfgs} == {None, *corr_config.IS_LEVELS}
  assert {c.is_mode for c in cfgs if c.is_level} == set(corr_config.IS_MODES)
  assert sorted(n for c in cfgs for n in c.rs) == sorted(rejection.RS_CRITERIA)
  assert any(c.veto_low for c in cfgs) and any(c.veto_high for c in cfgs)


# ------------------------------------------------------------------ data


def make_batch(
  rng: np.random.Generator,
  shape: tuple[int, int],
  *,
  density: float,
  scale: float,
  n_extreme: int = 0,
  empty_row: bool = False,
  reject_all: bool = False,
  nonfinite_valid: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Random `(train, rollout, mask)`, float32, zeros in padding.

  `scale` is the std of the log-ratio; `n_extreme` tokens get ±1e4;
  `reject_all` puts a −1e4 log-ratio in every non-empty row (vetoed by
  every `veto_low`); `nonfinite_valid` puts a NaN at a valid token.
  """
  b, t = shape
  mask = rng.random(shape) < density
  if empty_row:
    mask[rng.integers(b)] = False
  rollout = -np.abs(rng.normal(1.0, 1.0, shape))
  r = rng.normal(0.0, scale, shape)
  if n_extreme:
    idx = rng.integers(0, b * t, n_extreme)
    r.flat[idx] = rng.choice([-1e4, 1e4], n_extreme)
  if reject_all:
    for i in range(b):
      cols = np.flatnonzero(mask[i])
      if cols.size:
        r[i, cols[0]] = -1e4
  train = rollout + r
  if nonfinite_valid and mask.any():
    train.flat[rng.choice(np.flatnonzero(mask))] = np.nan
  train = np.where(mask, train, 0).astype(np.float32)
  rollout = np.where(mask, rollout, 0).astype(np.float32)
  return train, rollout, mask


@st.composite
def batch_params(draw, extreme: bool = True):
  return dict(
    seed=draw(st.integers(0, 2**32 - 1)),
    density=draw(st.sampled_from([0.0, 0.3, 0.8, 1.0])),
    scale=draw(st.sampled_from([0.0, 1e-3, 0.3, 3.0, 30.0])),
    n_extreme=draw(st.integers(0, 3)) if extreme else 0,
    empty_row=draw(st.booleans()),
    reject_all=draw(st.booleans()) if extreme else False,
    nonfinite_valid=draw(st.booleans()) if extreme else False,
  )


def batch(shape, p: dict):
  p = dict(p)
  rng = np.random.default_rng(p.pop('seed'))
  return make_batch(rng, shape, **p)


def with_padding(x: np.ndarray, mask: np.ndarray, value: float) -> np.ndarray:
  return np.where(mask, x, np.float32(value)).astype(np.float32)


def host(out: corr.Correction) -> tuple[np.ndarray, np.ndarray, dict]:
  return (
    np.asarray(out.weights),
    np.asarray(out.mask),
    {k: np.asarray(v) for k, v in out.metrics.items()},
  )


@functools.cache
def expected_keys(cfg: CC) -> frozenset:
  spec = jax.ShapeDtypeStruct((2, 3), jnp.float32)
  mask = jax.ShapeDtypeStruct((2, 3), jnp.bool_)
  out = jax.eval_shape(
    functools.partial(corr.rollout_correction, cfg=cfg), spec, spec, mask
  )
  return frozenset(out.metrics)


def metrics_close(a: dict, b: dict, scale: float, rtol=1e-5) -> None:
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_allclose(
      a[k], b[k], rtol=rtol, atol=1e-5 * scale, err_msg=k
    )


def input_scale(train, rollout, mask) -> float:
  vals = np.abs(np.concatenate([train[mask], rollout[mask]]))
  vals = vals[np.isfinite(vals)]
  return 1.0 + (float(vals.max()) if vals.size else 0.0)


# -------------------------------------------------------- invariants (jit)


@pytest.mark.parametrize('name', sorted(CONFIGS))
@settings(max_examples=10)
@hp.given(
  shape=st.sampled_from(SHAPES),
  params=batch_params(),
  garbage=st.sampled_from(GARBAGE),
  perm_seed=st.integers(0, 1000),
)
def test_invariants(name, shape, params, garbage, perm_seed):
  """Finite outputs, subset mask, fixed key set, padding and row-order
  invariance, on batches with ±1e4 log-ratios, empty and NaN rows."""
  cfg = CONFIGS[name]
  train, rollout, mask = batch(shape, params)
  w, out_mask, met = host(jitted(train, rollout, mask, cfg=cfg))

  # No NaN or Inf anywhere; the key set depends on cfg only.
  assert np.isfinite(w).all()
  assert all(np.isfinite(v) and v.shape == () for v in met.values())
  assert frozenset(met) == expected_keys(cfg)
  # The output never adds a token, and weights vanish outside it.
  assert not (out_mask & ~mask).any()
  assert (w[~out_mask] == 0).all()
  assert (w >= 0).all()
  bad_rows = ~np.isfinite(train).all(-1)
  assert not out_mask[bad_rows].any()
  if cfg.is_level is not None and cfg.is_mode == 'truncate':
    # Truncated weights are ≤ Cu before batch normalisation.
    factor = met.get(PREFIX + 'rollout_is_batch_norm_factor', 1.0)
    assert (w * factor <= cfg.is_upper * (1 + 1e-6)).all()

  # NaN / ±inf / 1e30 in the padding: bitwise identical results.
  w2, m2, met2 = host(
    jitted(
      with_padding(train, mask, garbage),
      with_padding(rollout, mask, -garbage),
      mask,
      cfg=cfg,
    )
  )
  np.testing.assert_array_equal(w2, w)
  np.testing.assert_array_equal(m2, out_mask)
  for k in met:
    np.testing.assert_array_equal(met2[k], met[k], err_msg=k)

  # Row permutation permutes the outputs and keeps the metrics.
  perm = np.random.default_rng(perm_seed).permutation(shape[0])
  w3, m3, met3 = host(jitted(train[perm], rollout[perm], mask[perm], cfg=cfg))
  np.testing.assert_array_equal(m3, out_mask[perm])
  np.testing.assert_allclose(w3, w[perm], rtol=1e-6, atol=1e-7)
  metrics_close(met3, met, input_scale(train, rollout, mask))


@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_jit_matches_eager(name):
  cfg = CONFIGS[name]
  rng = np.random.default_rng(7)
  train, rollout, mask = make_batch(
    rng, SHAPES[1], density=0.8, scale=0.5, n_extreme=2, empty_row=True
  )
  eager = host(corr.rollout_correction(train, rollout, mask, cfg))
  jit = host(jitted(train, rollout, mask, cfg=cfg))
  np.testing.assert_array_equal(jit[1], eager[1])
  np.testing.assert_allclose(jit[0], eager[0], rtol=1e-6, atol=1e-7)
  metrics_close(jit[2], eager[2], input_scale(train, rollout, mask), 1e-6)


def test_traces_once_per_shape():
  traces = []
  cfg = CONFIGS['metrics_only']

  @jax.jit
  def fn(train, rollout, mask):
    traces.append(train.shape)
    return corr.rollout_correction(train, rollout, mask, cfg)

  rng = np.random.default_rng(0)
  for density in (0.2, 0.9, 1.0):
    jax.block_until_ready(
      fn(*make_batch(rng, (3, 4), density=density, scale=1))
    )
  assert traces == [(3, 4)]
  jax.block_until_ready(fn(*make_batch(rng, (2, 4), density=0.5, scale=1)))
  assert traces == [(3, 4), (2, 4)]


def test_runs_under_transfer_guard():
  cfg = CONFIGS['seq_clip_rs']
  rng = np.random.default_rng(1)
  args = jax.device_put(make_batch(rng, SHAPES[1], density=0.7, scale=1.0))
  with jax.transfer_guard('disallow'):
    out = jitted(*args, cfg=cfg)  # traces, compiles and runs in the guard
    jax.block_until_ready(out)
    out = jitted(*args, cfg=cfg)
    jax.block_until_ready(out)
  assert np.isfinite(np.asarray(out.weights)).all()


@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_jaxpr_has_no_callbacks(name):
  spec = jax.ShapeDtypeStruct((4, 6), jnp.float32)
  mask = jax.ShapeDtypeStruct((4, 6), jnp.bool_)
  fn = functools.partial(corr.rollout_correction, cfg=CONFIGS[name])
  text = str(jax.make_jaxpr(fn)(spec, spec, mask))
  assert 'callback' not in text
  assert 'debug' not in text


# ------------------------------------------------------------- gradients


def _linear_functional(train, rollout, mask, cotangents, cfg):
  out = corr.rollout_correction(train, rollout, mask, cfg)
  leaves = [out.weights] + [out.metrics[k] for k in sorted(out.metrics)]
  return sum(jnp.sum(c * x) for c, x in zip(cotangents, leaves))


grad_fn = jax.jit(
  jax.grad(_linear_functional, argnums=(0, 1)), static_argnames='cfg'
)


@settings(max_examples=6)
@hp.given(
  name=st.sampled_from(['token_bn_rs_veto', 'geo_mask_bn_rs']),
  params=batch_params(),
  garbage=st.sampled_from(GARBAGE),
)
def test_gradient_is_exactly_zero(name, params, garbage):
  """Any scalar of the outputs (a random linear functional of every output)
  has gradient exactly 0 w.r.t. both log-probs, padding garbage included."""
  cfg = CONFIGS[name]
  train, rollout, mask = batch(SHAPES[1], params)
  rng = np.random.default_rng(params['seed'])
  n_leaves = 1 + len(expected_keys(cfg))
  cotangents = [rng.normal(size=SHAPES[1]).astype(np.float32)] + [
    np.float32(rng.normal()) for _ in range(n_leaves - 1)
  ]
  g_train, g_rollout = grad_fn(
    with_padding(train, mask, garbage),
    with_padding(rollout, mask, garbage),
    mask,
    cotangents,
    cfg=cfg,
  )
  assert not np.asarray(g_train).any()
  assert not np.asarray(g_rollout).any()
  assert np.isfinite(np.asarray(g_train)).all()


# -------------------------------------------------------------- sharding


@settings(max_examples=4)
@hp.given(params=batch_params())
def test_sharded_batch_matches_single_device(params):
  """Batch sharded over the 8 fake devices, mesh ('data', 'fsdp') = (4, 2).

  The config has a global batch-normalisation mean, token and sequence RS
  and both vetoes.
  """
  assert jax.device_count() == 8
  cfg = CONFIGS['token_bn_rs_veto']
  train, rollout, mask = batch(SHAPES[1], params)
  single = host(jitted(train, rollout, mask, cfg=cfg))
  mesh = jax.make_mesh((4, 2), ('data', 'fsdp'))
  sharding = NamedSharding(mesh, P(('data', 'fsdp'), None))
  args = [jax.device_put(x, sharding) for x in (train, rollout, mask)]
  assert args[0].sharding.shard_shape(train.shape) == (1, 7)
  out = jitted(*args, cfg=cfg)
  sharded = host(out)
  np.testing.assert_array_equal(sharded[1], single[1])
  np.testing.assert_allclose(sharded[0], single[0], rtol=1e-6, atol=1e-7)
  metrics_close(sharded[2], single[2], input_scale(train, rollout, mask))


# ------------------------------------------------ config-varying (eager)


def eager_batch(p: dict):
  return batch(EAGER_SHAPE, p)


@settings(max_examples=15)
@hp.given(
  level=st.sampled_from(corr_config.IS_LEVELS),
  upper=st.floats(0.1, 10.0),
  params=batch_params(),
)
def test_truncated_weights_never_exceed_cu(level, upper, params):
  train, rollout, mask = eager_batch(params)
  out = corr.rollout_correction(
    train, rollout, mask, CC(is_level=level, is_upper=upper)
  )
  w = np.asarray(out.weights)
  assert (w <= np.float32(upper)).all()
  assert np.isfinite(w).all()


@settings(max_examples=15)
@hp.given(
  level=st.sampled_from(corr_config.IS_LEVELS),
  mode=st.sampled_from(corr_config.IS_MODES),
  upper=st.floats(1.0, 10.0),
  params=batch_params(),
)
def test_batch_normalised_weights_have_mean_one(level, mode, upper, params):
  """Token level: mmean(w) = 1 on m; sequence/geometric: vmean(rmean(w)) = 1
  (when μ > 1e-8; otherwise the weights are left as they are)."""
  train, rollout, mask = eager_batch(params)
  cfg = CC(
    is_level=level, is_mode=mode, is_upper=upper, is_batch_normalize=True
  )
  out = corr.rollout_correction(train, rollout, mask, cfg)
  raw = corr.rollout_correction(
    train, rollout, mask, CC(is_level=level, is_mode=mode, is_upper=upper)
  )
  m = np.asarray(out.mask)  # = m: no RS or veto in these configs
  w = np.asarray(out.weights, np.float64)
  factor = float(out.metrics[PREFIX + 'rollout_is_batch_norm_factor'])
  if level == 'token':
    mu = float(raw.metrics[PREFIX + 'rollout_is_mean'])
    mean = w[m].sum() / max(m.sum(), 1)
  else:
    rows = m.any(-1)
    q = (np.asarray(raw.weights, np.float64) * m).sum(-1) / np.maximum(
      m.sum(-1), 1
    )
    mu = q[rows].mean() if rows.any() else 0.0
    mean = ((w * m).sum(-1) / np.maximum(m.sum(-1), 1))[rows].sum() / max(
      rows.sum(), 1
    )
  if mu > 1e-8:
    assert factor == pytest.approx(mu, rel=1e-5)
    assert mean == pytest.approx(1.0, rel=1e-5)
  else:
    assert factor == 1.0
    np.testing.assert_array_equal(
      np.asarray(out.weights), np.asarray(raw.weights)
    )


@st.composite
def band_with_one(draw):
  """A random config whose every band contains ratio 1."""
  level = draw(st.sampled_from((None, *corr_config.IS_LEVELS)))
  fields = dict(
    mode=draw(st.sampled_from(corr_config.MODES)),
    is_level=level,
    is_mode=draw(st.sampled_from(corr_config.IS_MODES)),
    is_upper=draw(st.floats(1.0, 10.0)),
    is_batch_normalize=level is not None and draw(st.booleans()),
  )
  if draw(st.booleans()):
    fields['is_lower'] = draw(st.floats(0.05, 1.0))
  names = draw(st.lists(st.sampled_from(rejection.RS_CRITERIA), unique=True))
  bounds = []
  for name in names:
    up = draw(st.floats(1.0, 5.0)) if name.endswith('k1') else 1e-3
    if name.endswith('mpe'):  # exp|r| = 1 exactly: up = 1 keeps it
      up = draw(st.floats(1.0, 5.0))
    lo = draw(st.floats(0.2, 1.0)) if name.endswith('k1') else None
    bounds.append((lo, up))
  if names:
    fields.update(rs=tuple(names), rs_bounds=tuple(bounds))
  if draw(st.booleans()):
    fields['veto_low'] = draw(st.floats(1e-6, 0.99))
  if draw(st.booleans()):
    fields['veto_high'] = draw(st.floats(1.01, 1e6))
  return CC(**fields)


@settings(max_examples=20)
@hp.given(cfg=band_with_one(), params=batch_params(extreme=False))
def test_identical_policies_change_nothing(cfg, params):
  """train == rollout: every weight 1, nothing rejected, kl = chi2 = 0."""
  _, rollout, mask = eager_batch(params)
  out = corr.rollout_correction(rollout, rollout, mask, cfg)
  np.testing.assert_array_equal(np.asarray(out.mask), mask)
  np.testing.assert_array_equal(
    np.asarray(out.weights), mask.astype(np.float32)
  )
  got = {k[len(PREFIX) :]: float(v) for k, v in out.metrics.items()}
  for name in ('kl', 'k3_kl', 'chi2_token', 'chi2_seq', 'log_ppl_diff'):
    assert got[name] == 0.0, name
  assert got['rejected_token_fraction'] == 0.0
  if cfg.rs:
    assert got['rollout_rs_masked_fraction'] == 0.0


@settings(max_examples=15)
@hp.given(
  taus=st.lists(st.floats(1e-8, 0.999), min_size=2, max_size=2, unique=True),
  high=st.booleans(),
  params=batch_params(),
)
def test_veto_is_monotone_in_tau(taus, high, params):
  """A stricter threshold (higher τ_lo, lower τ_hi) never keeps more."""
  train, rollout, mask = eager_batch(params)
  lo, hi = sorted(taus)
  if high:  # thresholds above 1: τ_hi = 1/τ
    strict, loose = CC(veto_high=1 / hi), CC(veto_high=1 / lo)
    key = 'rollout_is_veto_high_fraction'
  else:
    strict, loose = CC(veto_low=hi), CC(veto_low=lo)
    key = 'rollout_is_veto_fraction'
  a = corr.rollout_correction(train, rollout, mask, strict)
  b = corr.rollout_correction(train, rollout, mask, loose)
  assert not (np.asarray(a.mask) & ~np.asarray(b.mask)).any()
  assert float(a.metrics[PREFIX + key]) >= float(b.metrics[PREFIX + key])


# ------------------------------------------------------ dtypes and errors


def test_dtypes():
  spec = functools.partial(jax.ShapeDtypeStruct, (2, 3))
  mask = spec(jnp.bool_)
  fn = functools.partial(
    corr.rollout_correction, cfg=CONFIGS['token_bn_rs_veto']
  )
  out = jax.eval_shape(fn, spec(jnp.bfloat16), spec(jnp.bfloat16), mask)
  assert out.weights.dtype == jnp.float32
  assert all(v.dtype == jnp.float32 for v in out.metrics.values())
  assert out.mask.dtype == jnp.bool_
  with jax.enable_x64(True):
    out = jax.eval_shape(fn, spec(jnp.float64), spec(jnp.float32), mask)
    assert out.weights.dtype == jnp.float64
    assert all(v.dtype == jnp.float64 for v in out.metrics.values())


def test_trace_time_errors():
  x = jax.ShapeDtypeStruct((2, 3), jnp.float32)
  mask = jax.ShapeDtypeStruct((2, 3), jnp.bool_)
  cfg = CC(is_level='token')

  def trace(*args):
    return jax.eval_shape(
      functools.partial(corr.rollout_correction, cfg=cfg), *args
    )

  with pytest.raises(ValueError, match='rollout_logp'):
    trace(x, None, mask)
  with pytest.raises(ValueError, match='bool'):
    trace(x, x, jax.ShapeDtypeStruct((2, 3), jnp.float32))
  with pytest.raises(ValueError, match=r'shape.*\(2, 4\)'):
    trace(x, jax.ShapeDtypeStruct((2, 4), jnp.float32), mask)
  with pytest.raises(ValueError, match='CorrectionConfig'):
    corr.rollout_correction(np.zeros((2, 3)), np.zeros((2, 3)), None, None)


# ---------------------------------------------------------------- config

ALL_RS = ', '.join(rejection.RS_CRITERIA)
INVALID = [
  # (kwargs, field named in the message, allowed values in the message)
  (dict(mode='sync'), 'mode', "'decoupled', 'bypass'"),
  (dict(bypass_loss='ppo'), 'bypass_loss', "'ppo_clip', 'reinforce'"),
  (dict(bypass_loss='reinforce'), 'bypass_loss', "'ppo_clip' in decoupled"),
  (dict(is_level='tok'), 'is_level', "'token', 'sequence', 'geometric'"),
  (dict(is_mode='cap'), 'is_mode', "'truncate', 'clip', 'mask'"),
  (dict(is_upper=0.0), 'is_upper', 'finite float > 0'),
  (dict(is_upper=-1.0), 'is_upper', 'finite float > 0'),
  (dict(is_upper=math.inf), 'is_upper', 'finite float > 0'),
  (dict(is_upper=math.nan), 'is_upper', 'finite float > 0'),
  (dict(is_upper=True), 'is_upper', 'finite float > 0'),
  (dict(is_upper='2.0'), 'is_upper', 'finite float > 0'),
  (dict(is_lower=0.0), 'is_lower', '0 < is_lower <= is_upper'),
  (dict(is_lower=3.0), 'is_lower', '0 < is_lower <= is_upper'),
  (dict(is_lower=False), 'is_lower', '0 < is_lower <= is_upper'),
  (dict(is_batch_normalize=True), 'is_batch_normalize', 'False when'),
  (
    dict(is_level='token', is_batch_normalize=1),
    'is_batch_normalize',
    'True or False',
  ),
  (dict(rs='token_k4', rs_bounds=1.0), 'rs', ALL_RS),
  (dict(rs='token', rs_bounds=2.0), 'rs', "use 'token_k1'"),
  (dict(rs='sequence', rs_bounds=2.0), 'rs', "use 'seq_sum_k1'"),
  (dict(rs='geometric', rs_bounds=2.0), 'rs', "use 'seq_mean_k1'"),
  (dict(rs='token_k1,', rs_bounds=2.0), 'rs', 'empty criterion'),
  (dict(rs=('token_k2', 'token_k2'), rs_bounds=0.1), 'rs', 'duplicate'),
  (dict(rs=(3,), rs_bounds=0.1), 'rs', ALL_RS),
  (dict(rs='token_k2'), 'rs_bounds', 'one entry per rs criterion'),
  (dict(rs_bounds=0.1), 'rs_bounds', '() when rs is empty'),
  (
    dict(rs='token_k2,token_k3', rs_bounds='0.1,0.2,0.3'),
    'rs_bounds',
    'one entry per rs criterion',
  ),
  (dict(rs='token_k1', rs_bounds='2.0_0.5'), 'rs_bounds', '0 < lo <= up'),
  (dict(rs='token_k1', rs_bounds=((0.0, 2.0),)), 'rs_bounds', '0 < lo <= up'),
  (dict(rs='token_k1', rs_bounds='-1'), 'rs_bounds', '0 < lo <= up'),
  (dict(rs='token_k1', rs_bounds='abc'), 'rs_bounds', "parse 'abc'"),
  (dict(rs='token_k1', rs_bounds='0.5_x'), 'rs_bounds', "parse 'x'"),
  (dict(rs='token_k2', rs_bounds='0.1_2.0'), 'rs_bounds', 'single number up'),
  (dict(rs='seq_max_k3', rs_bounds=((0.1, 2.0),)), 'rs_bounds', 'up > 0'),
  (dict(rs='token_k3', rs_bounds=0), 'rs_bounds', 'up > 0'),
  (dict(rs='token_k3', rs_bounds=True), 'rs_bounds', 'up > 0'),
  (dict(rs='token_k1', rs_bounds=((1, 2, 3),)), 'rs_bounds', '(lo, up)'),
  (dict(veto_low=0.0), 'veto_low', '0 < veto_low < 1'),
  (dict(veto_low=1.0), 'veto_low', '0 < veto_low < 1'),
  (dict(veto_low=True), 'veto_low', '0 < veto_low < 1'),
  (dict(veto_high=1.0), 'veto_high', 'float > 1'),
  (dict(veto_high=0.5), 'veto_high', 'float > 1'),
]


@pytest.mark.parametrize(
  ('kwargs', 'field', 'allowed'),
  INVALID,
  ids=[f'{f}-{i}' for i, (_, f, _) in enumerate(INVALID)],
)
def test_invalid_config_names_field_value_and_allowed(kwargs, field, allowed):
  with pytest.raises(ValueError) as err:
    CC(**kwargs)
  msg = str(err.value)
  assert f'CorrectionConfig.{field}' in msg
  assert allowed in msg
  received = kwargs.get(field)
  if received is not None and not isinstance(received, (tuple, list)):
    assert f'invalid value {received!r}' in msg


def test_equality_boundary_and_defaults_are_valid():
  assert CC(is_level='token', is_mode='mask', is_lower=1.0, is_upper=1.0)
  assert CC(rs='token_k1', rs_bounds='1.0_1.0').rs_bounds == ((1.0, 1.0),)
  cfg = CC()
  assert (cfg.mode, cfg.bypass_loss, cfg.is_level, cfg.is_mode) == (
    'decoupled',
    'ppo_clip',
    None,
    'truncate',
  )
  assert (cfg.is_upper, cfg.is_lower, cfg.is_batch_normalize) == (
    2.0,
    None,
    False,
  )
  assert (cfg.rs, cfg.rs_bounds, cfg.veto_low, cfg.veto_high) == (
    (),
    (),
    None,
    None,
  )
  assert cfg.lower == 0.5


def test_string_list_and_tuple_forms_normalise_to_one_config():
  canonical = CC(
    rs=('token_k1', 'seq_max_k3', 'seq_mean_k1'),
    rs_bounds=((0.5, 2.0), (None, 0.01), (1 / 1.5, 1.5)),
  )
  forms = [
    CC(rs='token_k1,seq_max_k3,seq_mean_k1', rs_bounds='0.5_2.0,0.01,1.5'),
    CC(rs='token_k1, seq_max_k3 ,seq_mean_k1', rs_bounds='0.5_2.0, 0.01, 1.5'),
    CC(
      rs=['token_k1', 'seq_max_k3', 'seq_mean_k1'],
      rs_bounds=[[0.5, 2], 0.01, 1.5],
    ),
    CC(
      rs=('token_k1', 'seq_max_k3', 'seq_mean_k1'),
      rs_bounds=('0.5_2.0', 0.01, '1.5'),
    ),
    CC(
      **ml_collections.ConfigDict(
        dict(
          rs=['token_k1', 'seq_max_k3', 'seq_mean_k1'],
          rs_bounds=[[0.5, 2.0], 0.01, 1.5],
        )
      ).to_dict()
    ),
    CC(rs=canonical.rs, rs_bounds=canonical.rs_bounds),
  ]
  for cfg in forms:
    assert cfg == canonical
    assert hash(cfg) == hash(canonical)
  assert canonical.rs_bounds[1] == (None, 0.01)
  # One bound for all criteria; a bare number for k1 is up with lo = 1/up.
  shared = CC(rs='token_k2,seq_max_k2', rs_bounds=0.5)
  assert shared.rs_bounds == ((None, 0.5), (None, 0.5))
  assert CC(rs='token_k1', rs_bounds=2).rs_bounds == ((0.5, 2.0),)
  assert isinstance(CC(is_upper=3).is_upper, float)


def test_config_is_hashable_and_frozen():
  cfg = CONFIGS['geo_mask_bn_rs']
  assert {cfg: 1}[CC(**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__})]
  with pytest.raises(AttributeError):
    cfg.is_upper = 3.0  # type: ignore[misc]
  # Usable as a static jit argument: equal configs share one cache entry.
  assert jax.jit(lambda c: 0, static_argnums=0)(cfg) == 0


# ------------------------------------------- metrics without a reference


def test_new_metrics_match_hand_derivation():
  """The metrics that no reference has (marked "new" in
  docs/math/correction.md §5), derived in float64 on the verl batch with an
  empty row and two non-finite rows."""
  from tests.helpers import correction_golden_map as gm

  d = gm.load('verl').dataset()
  train, rollout = d['old_log_prob'].copy(), d['rollout_log_prob'].copy()
  m0 = d['response_mask'] > 0
  m0[4] = False  # an empty row
  rollout[2, 3] = -np.inf
  train[7, 0] = np.nan
  train[0, 31] = 1e30  # a valid, finite outlier: kept, vetoed by veto_high
  cfg = CC(
    is_level='sequence',
    is_upper=2.0,
    rs='seq_mean_k3',
    rs_bounds=0.01,
    veto_high=3.0,
  )
  out = corr.rollout_correction(train, rollout, m0, cfg)
  got = {k[len(PREFIX) :]: float(v) for k, v in out.metrics.items()}

  bad = ~(np.isfinite(train) & np.isfinite(rollout) | ~m0).all(-1)
  assert bad.tolist() == [False, False, True, False, False, False, False, True]
  m = m0 & ~bad[:, None]
  r = np.where(m, train - rollout, 0).astype(np.float32).astype(np.float64)
  rows0, rows = m0.any(-1), m.any(-1)
  s = r.sum(-1)
  q = np.minimum(np.exp(np.clip(s, -20, 20)), 2.0)  # rmean(w) at seq level
  rc = np.clip(r, -20, 20)
  k3_mean = ((np.exp(rc) - 1 - rc) * m).sum(-1) / np.maximum(m.sum(-1), 1)
  cat_hi = m & (r > np.log(3.0))
  veto_hi = cat_hi.any(-1)
  out_mask = m & ((k3_mean <= 0.01) & ~veto_hi)[:, None]
  np.testing.assert_array_equal(np.asarray(out.mask), out_mask)
  assert veto_hi[0]
  hand = {
    'nonfinite_rollout_logp_count': 1,
    'nonfinite_train_logp_count': 1,
    'nonfinite_seq_fraction': 2 / rows0.sum(),
    'rejected_token_fraction': 1 - out_mask.sum() / m0.sum(),
    'rejected_seq_fraction': (m0 & ~out_mask).any(-1)[rows0].mean(),
    'rollout_is_seq_eff_sample_size': q[rows].sum() ** 2
    / (rows.sum() * (q[rows] ** 2).sum()),
    'rollout_is_veto_high_fraction': veto_hi[rows].mean(),
    'rollout_is_catastrophic_high_token_fraction': cat_hi.sum() / m.sum(),
  }
  for name, value in hand.items():
    assert got[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name


@pytest.mark.parametrize('t', [1, 2, 5, 8, 33])
def test_pairwise_row_sum(t):
  """The private pairwise sum: exact on integers, masked, ~1 ulp on floats."""
  rng = np.random.default_rng(t)
  mask = rng.random((3, t)) < 0.7
  ints = rng.integers(-50, 50, (3, t)).astype(np.float32)
  got = np.asarray(masked.row_sum_pairwise(jnp.asarray(ints), mask))
  np.testing.assert_array_equal(got, (ints * mask).sum(-1))
  garbage = np.where(mask, ints, np.nan).astype(np.float32)
  got = np.asarray(masked.row_sum_pairwise(jnp.asarray(garbage), mask))
  np.testing.assert_array_equal(got, (ints * mask).sum(-1))
  x = rng.normal(0, 1, (3, t)).astype(np.float32)
  exact = (x.astype(np.float64) * mask).sum(-1)
  got = np.asarray(masked.row_sum_pairwise(jnp.asarray(x), mask))
  np.testing.assert_allclose(got, exact, rtol=0, atol=4e-7 * max(1, t) ** 0.5)
