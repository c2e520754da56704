"""Policy-loss properties: reductions, edge cases, JAX contract, errors."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcorr.losses import aggregate as agg_lib
from jaxcorr.losses import policy

NAMES = tuple(policy.LOSSES)


# `loss=<name>` ids: a bare `[prime]` id would be counted as a prime-rl golden
# case by the conformance summary in conftest.py.
def loss_id(name):
  return f'loss={name}'


MODES = agg_lib.MODES
KEY = jax.random.key(7)
TOL = dict(rtol=1e-6, atol=1e-6)
# Knobs that make every loss do something on small batches (and dro valid).
KNOBS = {
  'dro': {'dro_beta': 0.1},
  'clip_cov': {
    'clip_cov_ratio': 0.2,
    'clip_cov_lb': -10.0,
    'clip_cov_ub': 10.0,
  },
  'kl_cov': {'kl_cov_ratio': 0.2},
  'prime': {'prime_mask_low': 0.05, 'prime_mask_high': 0.05},
}
# Losses whose selection uses statistics of the whole batch (means of A and
# logp, a top-k or a random draw over all tokens): a micro-batch is a
# different batch for them.
BATCH_COUPLED = ('clip_cov', 'kl_cov', 'm2po')  # m2po: one τ per call


class Batch(NamedTuple):
  logp: np.ndarray
  old: np.ndarray
  adv: np.ndarray
  mask: np.ndarray
  w: np.ndarray
  rollout: np.ndarray


def make_batch(seed=0, B=8, T=8, lengths=None, delta=0.3) -> Batch:
  """Log-probs ≤ 0, an empty row, a full row and a hole in row 1."""
  rng = np.random.default_rng(seed)
  if lengths is None:
    lengths = rng.integers(1, T + 1, size=B)
    lengths[0], lengths[-1] = T, 0
  mask = np.arange(T)[None] < np.asarray(lengths)[:, None]
  if B > 1 and T > 4:
    mask[1, 2:4] = False
  old = -np.abs(rng.normal(1.0, 0.7, (B, T)))
  logp = np.minimum(old + rng.normal(0, delta, (B, T)), 0.0)
  rollout = np.minimum(old + rng.normal(0, delta, (B, T)), 0.0)
  adv = rng.normal(0, 1, (B, T))
  adv[:, -1] = 0.0  # A = 0 exercises the "else" branches
  w = rng.uniform(0.3, 2.0, (B, T))
  f32 = lambda x: x.astype(np.float32)  # noqa: E731
  return Batch(f32(logp), f32(old), f32(adv), mask, f32(w), f32(rollout))


def call(name, logp, old, adv, mask, w, rollout, *, agg=None, **extra):
  """`policy_loss` with the test knobs (and any knob in `extra`); w is
  dropped where not allowed."""
  knobs = {k: v for k, v in extra.items() if k in policy.KNOB_FIELDS}
  rest = {k: v for k, v in extra.items() if k not in knobs}
  return policy.policy_loss(
    name,
    logp,
    old,
    adv,
    mask,
    is_weights=w if policy.USES_IS_WEIGHTS[name] else None,
    agg=agg,
    rollout_logp=rollout,
    key=KEY if name == 'clip_cov' else None,
    knobs=policy.check_knobs({**KNOBS.get(name, {}), **knobs}),
    **rest,
  )


def loss_and_grads(name, b: Batch, *, agg=None, argnums=(0,), **extra):
  """`(loss, metrics), grads` w.r.t. the positional inputs in `argnums`."""

  def fn(logp, old, adv, w, rollout):
    return call(name, logp, old, adv, b.mask, w, rollout, agg=agg, **extra)

  vg = jax.value_and_grad(fn, argnums=argnums, has_aux=True)
  return vg(b.logp, b.old, b.adv, b.w, b.rollout)


@functools.cache
def jitted(name, agg=None):
  """Reused jitted `value_and_grad` w.r.t. logp, one per static config."""

  def fn(logp, old, adv, mask, w, rollout):
    return call(name, logp, old, adv, mask, w, rollout, agg=agg)

  return jax.jit(jax.value_and_grad(fn, has_aux=True))


def run_jit(name, b: Batch, agg=None):
  return jitted(name, agg)(b.logp, b.old, b.adv, b.mask, b.w, b.rollout)


def assert_tree_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_tree_close(a, b, **tol):
  tol = {**TOL, **tol}
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


# ================================================================ tables


def test_tables_cover_the_registry():
  assert set(policy.LOSSES) == {
    'vanilla', 'gspo', 'gspo_seq', 'sapo', 'gpg', 'cispo', 'clip_cov',
    'kl_cov', 'geo_mean', 'dro', 'dppo_tv', 'dppo_kl', 'reinforce',
    'rollout_is', 'prime', 'cispo_rollout', 'dppo_mu_tv', 'dppo_mu_kl',
    'm2po', 'topr',
  }  # fmt: skip
  for table in (policy.NATURAL_AGG, policy.READS, policy.USES_IS_WEIGHTS):
    assert set(table) == set(policy.LOSSES)
  for name, mode in policy.NATURAL_AGG.items():
    assert agg_lib.canonical_mode(mode) == mode, name
  assert policy.READS['gpg'] is None
  mu_anchored = {'rollout_is', 'prime', 'cispo_rollout', 'dppo_mu_tv'}
  mu_anchored |= {'dppo_mu_kl'}
  assert {n for n, r in policy.READS.items() if r == 'rollout'} == mu_anchored
  assert {n for n, u in policy.USES_IS_WEIGHTS.items() if not u} == mu_anchored
  assert len(dataclasses.fields(policy.PolicyKnobs)) == 25
  assert policy.check_knobs({}) == policy.DEFAULT_KNOBS  # defaults valid


# ============================================================ reduces-to


@pytest.mark.parametrize('agg', [None, 'token_mean', 'seq_mean_token_mean'])
def test_vanilla_on_policy_is_minus_mean_advantage(agg):
  b = make_batch(1)
  loss, _ = call('vanilla', b.old, b.old, b.adv, b.mask, None, None, agg=agg)
  if agg is None:  # the natural token_mean: −mean(A) over the mask
    np.testing.assert_allclose(loss, -b.adv[b.mask].mean(), **TOL)
  np.testing.assert_allclose(
    loss, agg_lib.aggregate(-b.adv, b.mask, agg or 'token_mean'), **TOL
  )


def _row_constant(adv):
  return np.broadcast_to(adv[:, :1], adv.shape).copy()


@pytest.mark.parametrize('mode', MODES)
def test_gspo_and_gspo_seq(mode):
  b = make_batch(2)
  knobs = {'clip_ratio_low': 0.05, 'clip_ratio_high': 0.08}
  (va, _), ga = loss_and_grads('gspo', b, agg=mode, **knobs)
  (vb, _), gb = loss_and_grads('gspo_seq', b, agg=mode, **knobs)
  np.testing.assert_allclose(va, vb, **TOL)
  # General A: the gradients differ (token form vs sequence form) ...
  assert not np.allclose(ga, gb, rtol=1e-3, atol=1e-5)
  # ... but with A constant per row (and w = 1) they coincide.
  b = b._replace(adv=_row_constant(b.adv), w=None)
  (va, _), ga = loss_and_grads('gspo', b, agg=mode, **knobs)
  (vb, _), gb = loss_and_grads('gspo_seq', b, agg=mode, **knobs)
  np.testing.assert_allclose(va, vb, **TOL)
  assert_tree_close(ga, gb)


@pytest.mark.parametrize('weighted', [False, True])
@pytest.mark.parametrize('mode', MODES)
def test_reinforce_equals_gpg(mode, weighted):
  b = make_batch(3)
  if not weighted:
    b = b._replace(w=None)
  (va, ma), ga = loss_and_grads('reinforce', b, agg=mode)
  (vb, mb), gb = loss_and_grads('gpg', b, agg=mode)
  np.testing.assert_array_equal(va, vb)
  assert_tree_equal(ga, gb)
  assert mb == {} and set(ma) == {'actor/ppo_kl'}
  np.testing.assert_allclose(
    ma['actor/ppo_kl'], (b.old - b.logp)[b.mask].mean(), **TOL
  )
  _, mc = call('reinforce', b.logp, None, b.adv, b.mask, None, None)
  assert mc == {}


def test_cispo_logs_its_ratio_like_cispo_rollout():
  """π_old-anchored cispo logs `actor/cispo_ratio_*` as SkyRL does and as
  cispo_rollout does: with μ = π_old the two losses are one loss, so their
  values, gradients and ratio metrics agree bit for bit."""
  b = make_batch(4, delta=1.0)  # a wide ratio: both clip bounds bind
  knobs = {'cispo_clip_low': 0.2, 'cispo_clip_high': 0.3}
  (va, ma), ga = loss_and_grads('cispo', b._replace(w=None), **knobs)
  anchored = b._replace(rollout=b.old, w=None)
  (vb, mb), gb = loss_and_grads('cispo_rollout', anchored, **knobs)
  ratio = {f'actor/cispo_ratio_{s}' for s in ('mean', 'clamped_mean')}
  ratio |= {'actor/cispo_ratio_max', 'actor/cispo_ratio_min'}
  assert ratio <= set(ma) and set(mb) == ratio | {'actor/pg_clipfrac'}
  np.testing.assert_array_equal(va, vb)
  assert_tree_equal(ga, gb)
  for key in (*sorted(ratio), 'actor/pg_clipfrac'):
    np.testing.assert_array_equal(ma[key], mb[key], err_msg=key)
  rho = np.exp(b.logp - b.old)[b.mask]
  np.testing.assert_allclose(ma['actor/cispo_ratio_max'], rho.max(), **TOL)
  np.testing.assert_allclose(
    ma['actor/cispo_ratio_clamped_mean'], np.clip(rho, 0.8, 1.3).mean(), **TOL
  )
  assert 0 < float(ma['actor/pg_clipfrac']) < 1


def test_binary_tv_equals_primerl_loss_without_kl():
  """SkyRL's μ-anchored binary-TV DPPO = prime with prime_kl_tau = 0: the
  same mask and gradient as dppo_tv anchored at μ without a ratio cap
  (values differ: −A·ρ_μ versus the surrogate −A·sg(ρ_μ)·logp)."""
  b = make_batch(4, delta=0.8)
  band = dict(prime_mask_low=0.05, prime_mask_high=0.08, prime_kl_tau=0.0)

  def prime(lp):
    return policy.policy_loss(
      'prime', lp, None, b.adv, b.mask, rollout_logp=b.rollout,
      knobs=policy.check_knobs(band),
    )  # fmt: skip

  def dppo(lp):
    return policy.policy_loss(
      'dppo_tv', lp, b.rollout, b.adv, b.mask,
      knobs=policy.PolicyKnobs(
        clip_ratio_c=None, dppo_delta_low=0.05, dppo_delta_high=0.08
      ),
    )  # fmt: skip

  (_, mp), gp = jax.value_and_grad(prime, has_aux=True)(b.logp)
  (_, md), gd_ = jax.value_and_grad(dppo, has_aux=True)(b.logp)
  np.testing.assert_allclose(gp, gd_, **TOL)
  frac = mp['actor/prime_is_masked']
  assert 0 < frac < 1
  np.testing.assert_allclose(frac, md['actor/pg_clipfrac'], **TOL)


def _np_vanilla(b, lo, hi, c):
  rho = np.exp(b.logp - b.old)
  l1, l2 = -b.adv * rho, -b.adv * np.clip(rho, 1 - lo, 1 + hi)
  lc = np.maximum(l1, l2)
  ell = lc if c is None else np.where(b.adv < 0, np.minimum(-b.adv * c, lc), lc)
  return (ell * b.w)[b.mask].mean()


@pytest.mark.parametrize('c', [1.5, None])
def test_vanilla_dual_clip_against_numpy(c):
  b = make_batch(5, delta=1.5)
  (loss, m), _ = loss_and_grads(
    'vanilla', b, clip_ratio_c=c, clip_ratio_high=0.3
  )
  np.testing.assert_allclose(loss, _np_vanilla(b, 0.2, 0.3, c), rtol=1e-5)
  if c is None:
    assert m['actor/pg_clipfrac_lower'] == 0
  else:
    assert m['actor/pg_clipfrac_lower'] > 0
    assert not np.isclose(loss, _np_vanilla(b, 0.2, 0.3, None), rtol=1e-3)


def test_zero_advantage_uses_the_low_test_in_primerl_loss():
  """A = 0 with pd < −low counts as masked (and in the masked mismatch KL)
  but not in prime_is_masked_low, which requires A < 0."""
  T = 4
  mask = np.ones((1, T), bool)
  roll = np.log(np.full((1, T), 0.9, np.float32))
  logp = np.log(np.array([[0.5, 0.5, 0.89, 0.89]], np.float32))
  adv = np.array([[0.0, -1.0, 0.0, 1.0]], np.float32)
  _, m = policy.policy_loss(
    'prime', logp, None, adv, mask, rollout_logp=roll,
    knobs=policy.PolicyKnobs(prime_mask_low=0.2),
  )  # fmt: skip
  np.testing.assert_allclose(m['actor/prime_is_masked'], 0.5)
  np.testing.assert_allclose(m['actor/prime_is_masked_low'], 0.25)
  np.testing.assert_allclose(m['actor/prime_is_masked_high'], 0.0)
  r = np.log(0.5 / 0.9)
  np.testing.assert_allclose(
    m['actor/prime_masked_mismatch_kl'], np.exp(r) - r - 1, rtol=1e-5
  )


# ============================================================ selections


def test_clip_cov_draw_picks_min_n_candidates():
  b = make_batch(6, delta=0.5)
  n_tok = int(b.mask.sum())
  for ratio, want in ((0.05, max(math.floor(0.05 * n_tok), 1)), (1.0, None)):
    picks = []
    for seed in range(3):
      _, m = policy.policy_loss(
        'clip_cov', b.logp, b.old, b.adv, b.mask, key=jax.random.key(seed),
        knobs=policy.PolicyKnobs(
          clip_cov_ratio=ratio, clip_cov_lb=-1e9, clip_cov_ub=1e9
        ),
      )  # fmt: skip
      picks.append(round(float(m['actor/pg_clipfrac']) * n_tok))
    rho = np.exp(b.logp - b.old)
    l1, l2 = -b.adv * rho, -b.adv * np.clip(rho, 0.8, 1.2)
    n_cand = int((b.mask & ~(l2 > l1)).sum())
    assert picks == [min(want or n_cand, n_cand)] * 3


def test_clip_cov_key_changes_selection_and_pick_is_honoured():
  b = make_batch(7)
  knobs = policy.PolicyKnobs(
    clip_cov_ratio=0.1, clip_cov_lb=-1e9, clip_cov_ub=1e9
  )

  def grad(**kw):
    fn = lambda lp: policy.policy_loss(  # noqa: E731
      'clip_cov', lp, b.old, b.adv, b.mask, **kw, knobs=knobs
    )[0]
    return np.asarray(jax.grad(fn)(b.logp))

  g0, g1 = grad(key=jax.random.key(0)), grad(key=jax.random.key(1))
  assert not np.array_equal(g0, g1)
  pick = np.zeros_like(b.mask)
  pick[0, :3] = True
  gp = grad(clip_cov_pick=pick)
  assert np.all(gp[0, :3] == 0) and np.any(gp[0, 3:] != 0)


def test_kl_cov_ties_go_to_the_lowest_flat_index():
  B, T = 3, 5
  mask = np.ones((B, T), bool)
  mask[0, 0] = False
  logp = np.full((B, T), -1.0, np.float32)
  old = logp - 0.1  # δ = 0.1 everywhere, cov = 0 everywhere: all tied
  adv = np.ones((B, T), np.float32)

  def fn(lp):
    return policy.policy_loss(
      'kl_cov', lp, old, adv, mask, agg='token_sum',
      knobs=policy.PolicyKnobs(kl_cov_ratio=0.15, ppo_kl_coef=0.5),
    )[0]  # fmt: skip

  g = np.asarray(jax.grad(fn)(logp))
  base = -np.exp(0.1)
  picked = np.argwhere(~np.isclose(g, base) & mask)
  # max(1, ⌊14·0.15⌋) = 2 tokens: the first two valid flat indices.
  np.testing.assert_array_equal(picked, [[0, 1], [0, 2]])
  np.testing.assert_allclose(g[0, 1:3], base + 0.5, rtol=1e-6)


# ============================================================ edge cases


@pytest.mark.parametrize('name', NAMES, ids=loss_id)
def test_all_masked_is_exact_zero(name):
  b = make_batch(8)
  b = b._replace(mask=np.zeros_like(b.mask))
  for mode in MODES:
    (loss, metrics), grads = loss_and_grads(
      name, b, agg=mode, argnums=(0, 1, 2, 3, 4)
    )
    assert float(loss) == 0.0 and not np.signbit(loss), mode
    for g in grads:
      np.testing.assert_array_equal(g, 0.0)
    for k, v in metrics.items():
      assert v.shape == () and np.isfinite(v), k


@pytest.mark.parametrize('fill', [np.nan, np.inf, -np.inf, 1e30])
@pytest.mark.parametrize('name', NAMES, ids=loss_id)
def test_padding_garbage_is_bitwise_invisible(name, fill):
  b = make_batch(9)
  pad = ~b.mask
  junk = Batch(*(np.where(pad, fill, v) if v.dtype != bool else v for v in b))
  clean = Batch(*(np.where(pad, 0, v) if v.dtype != bool else v for v in b))
  for mode in (None, 'seq_mean_token_sum'):
    want = loss_and_grads(name, clean, agg=mode)
    got = loss_and_grads(name, junk, agg=mode)
    assert_tree_equal(got, want)


@pytest.mark.parametrize('name', NAMES, ids=loss_id)
def test_extreme_log_ratios_are_finite(name):
  b = make_batch(10)
  sign = np.where(np.arange(8) % 2 == 0, 1.0, -1.0).astype(np.float32)
  old = np.full((8, 8), -40.0, np.float32)
  logp = old + 30 * sign  # δ = ±30, log-probs stay ≤ 0
  b = b._replace(logp=logp, old=old, rollout=old - 30 * sign)
  for mode in MODES:
    (loss, metrics), grads = loss_and_grads(
      name, b, agg=mode, argnums=(0, 1, 2, 3, 4)
    )
    assert np.isfinite(loss), mode
    for g in jax.tree.leaves(grads):
      assert np.all(np.isfinite(g)), mode
    for k, v in metrics.items():
      assert np.isfinite(v), k


@pytest.mark.parametrize('name', NAMES, ids=loss_id)
def test_bf16_is_upcast(name):
  b = make_batch(11)
  b16 = Batch(*(v.astype(jnp.bfloat16) if v.dtype != bool else v for v in b))
  loss, metrics = call(name, *b16)
  assert loss.dtype == jnp.float32
  assert all(v.dtype == jnp.float32 for v in metrics.values())


# ============================================================ JAX contract


@pytest.mark.parametrize('name', NAMES, ids=loss_id)
def test_jit_equals_eager_and_metric_keys_are_static(name):
  b = make_batch(12)
  eager = loss_and_grads(name, b)
  got = run_jit(name, b)
  assert_tree_close(got, eager)
  other = run_jit(name, make_batch(13))
  assert set(other[0][1]) == set(got[0][1])


def _sub_jaxprs(value):
  if hasattr(value, 'eqns'):
    yield value
  elif hasattr(value, 'jaxpr') and hasattr(value.jaxpr, 'eqns'):
    yield value.jaxpr
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from _sub_jaxprs(v)


def _primitives(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn.primitive.name
    for value in eqn.params.values():
      for sub in _sub_jaxprs(value):
        yield from _primitives(sub)


@pytest.mark.parametrize('name', NAMES, ids=loss_id)
def test_no_callbacks_in_jaxpr(name):
  b = make_batch(14)

  def fn(logp):
    return call(name, logp, b.old, b.adv, b.mask, b.w, b.rollout)

  jaxpr = jax.make_jaxpr(jax.value_and_grad(fn, has_aux=True))(b.logp)
  prims = set(_primitives(jaxpr.jaxpr))
  assert not {p for p in prims if 'callback' in p}, prims


@pytest.mark.parametrize('name', NAMES, ids=loss_id)
def test_no_gradient_through_constants(name):
  b = make_batch(15)
  for mode in (None, 'token_sum'):
    _, (g_old, g_adv, g_w, g_roll) = loss_and_grads(
      name, b, agg=mode, argnums=(1, 2, 3, 4)
    )
    for g in (g_old, g_adv, g_w, g_roll):
      np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize('name', NAMES, ids=loss_id)
def test_sharded_batch_equals_single_device(name):
  assert jax.device_count() == 8
  b = make_batch(16)
  want = run_jit(name, b)
  mesh = jax.make_mesh((8,), ('data',))
  rows = NamedSharding(mesh, P('data', None))
  sharded = Batch(*(jax.device_put(v, rows) for v in b))
  got = run_jit(name, sharded)
  assert len(got[1].sharding.device_set) == 8
  assert_tree_close(got, want, rtol=2e-6)


@pytest.mark.parametrize(
  'name', [n for n in NAMES if n not in BATCH_COUPLED], ids=loss_id
)
def test_micro_batches_with_global_counts_match_full_batch(name):
  b = make_batch(17)
  n_tok = b.mask.sum()
  n_seq = b.mask.any(-1).sum()
  parts = (slice(0, 4), slice(4, 8))
  for mode in MODES:
    (full, _), g_full = loss_and_grads(name, b, agg=mode, norm=8.0)
    total, grads = 0.0, []
    for rows in parts:
      sub = Batch(*(v[rows] for v in b))
      (loss, _), g = loss_and_grads(
        name, sub, agg=mode, num_tokens=n_tok, num_seqs=n_seq, norm=8.0
      )
      total += loss
      grads.append(g[0])
    np.testing.assert_allclose(total, full, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
      np.concatenate(grads), g_full[0], rtol=1e-5, atol=1e-6
    )


@hypothesis.settings(max_examples=15, deadline=None)
@hypothesis.given(
  name=st.sampled_from(NAMES),
  lengths=st.lists(st.integers(0, 8), min_size=8, max_size=8),
  seed=st.integers(0, 2**16),
  mode=st.sampled_from(MODES),
)
def test_random_padding_and_row_order(name, lengths, seed, mode):
  """Random lengths (empty rows included): the loss is invariant to the
  padding content and, for row-separable losses, to the row order."""
  b = make_batch(seed, lengths=lengths, delta=0.6)
  (loss, metrics), g = run_jit(name, b, mode)
  junk = Batch(
    *(np.where(~b.mask, np.nan, v) if v.dtype != bool else v for v in b)
  )
  assert_tree_equal(run_jit(name, junk, mode), ((loss, metrics), g))
  if name in BATCH_COUPLED:
    return
  perm = np.random.default_rng(seed).permutation(8)
  (lp, mp), gp = run_jit(name, Batch(*(v[perm] for v in b)), mode)
  np.testing.assert_allclose(lp, loss, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(gp, np.asarray(g)[perm], rtol=1e-5, atol=1e-6)
  assert_tree_close(mp, metrics, rtol=1e-5)


# ================================================================= knobs


@pytest.mark.parametrize(
  ('knob', 'suggestion'),
  [
    ('clip_ratio_hgih', 'clip_ratio_high'),
    ('tau_pso', 'tau_pos'),
    ('dro_bet', 'dro_beta'),
    ('eps_clip_high', 'clip_ratio_high'),
    ('kl_cov_frac', 'kl_cov_ratio'),
    ('clip_ratio', 'clip_ratio_low and clip_ratio_high'),
  ],
)
def test_unknown_knob_suggests_the_closest(knob, suggestion):
  with pytest.raises(ValueError, match='unknown policy-loss knob') as err:
    policy.check_knobs({knob: 0.2})
  assert repr(knob) in str(err.value) and suggestion in str(err.value)
  b = make_batch(18)
  with pytest.raises(ValueError, match=suggestion):
    policy.policy_loss(
      'vanilla', b.logp, b.old, b.adv, b.mask,
      knobs=policy.check_knobs({knob: 0.2}),
    )  # fmt: skip


BAD_KNOBS = [
  ({'clip_ratio_low': -0.1}, '>= 0'),
  ({'clip_ratio_high': float('nan')}, '>= 0'),
  ({'clip_ratio_high': '0.2'}, '>= 0'),
  ({'clip_ratio_c': 1.0}, '> 1, or None'),
  ({'clip_ratio_c': True}, '> 1, or None'),
  ({'tau_pos': 0.0}, '> 0'),
  ({'tau_neg': -1.0}, '> 0'),
  ({'clip_cov_ratio': 0.0}, '> 0'),
  ({'clip_cov_lb': 5.0}, 'clip_cov_lb < clip_cov_ub'),
  ({'clip_cov_lb': 1.0, 'clip_cov_ub': 1.0}, 'clip_cov_lb < clip_cov_ub'),
  ({'kl_cov_ratio': -0.1}, '> 0'),
  ({'ppo_kl_coef': -0.1}, '>= 0'),
  ({'dro_beta': 0.0}, '> 0'),
  ({'dppo_delta_low': 0.0}, '> 0, or None'),
  ({'dppo_ratio_cap': -1.0}, '> 0, or None'),
  ({'cispo_clip_high': -0.5}, '>= 0, or None'),
  ({'prime_mask_low': 0.0}, '> 0'),
  ({'prime_kl_tau': -1e-3}, '>= 0'),
  ({'prime_adv_tau': float('nan')}, 'not NaN'),
]


@pytest.mark.parametrize(('knobs', 'allowed'), BAD_KNOBS)
def test_invalid_knob_values(knobs, allowed):
  with pytest.raises(ValueError) as err:
    policy.check_knobs(knobs)
  msg = str(err.value)
  assert allowed in msg
  for key in knobs:  # the knob (and its value) are named
    assert key in msg
  assert repr(next(iter(knobs.values()))) in msg


def test_valid_knob_values_and_dro_requirement():
  policy.check_knobs(
    {
      'clip_ratio_c': None,
      'clip_ratio_high': float('inf'),
      'dppo_ratio_cap': 10,
      'cispo_clip_low': 0,
      'prime_adv_tau': -1.0,
      'clip_cov_lb': -1e9,
    }
  )
  policy.check_knobs({}, name='vanilla')  # dro_beta None is fine elsewhere
  with pytest.raises(ValueError, match=r'dro_beta=None.*must be a positive'):
    policy.check_knobs({}, name='dro')
  policy.check_knobs({'dro_beta': 0.1}, name='dro')
  with pytest.raises(ValueError, match="unknown policy loss 'ppo'"):
    policy.check_knobs({}, name='ppo')


def test_unused_known_knobs_are_ignored():
  b = make_batch(19)
  want = call('gpg', *b)
  got = call('gpg', *b, tau_pos=3.0, kl_cov_ratio=0.5, prime_kl_tau=1.0)
  assert_tree_equal(got, want)


# ========================================================= trace-time errors


def test_unknown_loss_name_lists_valid_names():
  b = make_batch(20)
  with pytest.raises(ValueError) as err:
    policy.policy_loss('gsop', b.logp, b.old, b.adv, b.mask)
  msg = str(err.value)
  assert "did you mean 'gspo'" in msg
  for name in NAMES:
    assert name in msg


@pytest.mark.parametrize(
  ('name', 'change', 'match'),
  [
    ('vanilla', {'mask': 'float'}, 'must have dtype bool'),
    ('vanilla', {'old': 'short'}, 'shape mismatch'),
    ('vanilla', {'w': 'short'}, 'shape mismatch'),
    ('vanilla', {'old': None}, 'old_logp is required'),
    ('dppo_kl', {'old': None}, 'old_logp is required'),
    ('prime', {'rollout': None}, 'rollout_logp is required'),
    ('rollout_is', {'rollout': None}, 'rollout_logp is required'),
    ('prime', {'w': 'weights'}, 'is_weights must be None'),
    ('rollout_is', {'w': 'weights'}, 'is_weights must be None'),
    ('clip_cov', {'key': None}, 'key is required'),
    ('clip_cov', {'pick': 'float'}, 'clip_cov_pick must have dtype bool'),
    ('vanilla', {'agg': 'seq-mean'}, 'not an aggregation mode'),
    ('vanilla', {'logp': '1d'}, 'expected 2-d'),
  ],
)
def test_trace_time_errors(name, change, match):
  b = make_batch(21)
  args = dict(
    logp=b.logp, old=b.old, adv=b.adv, mask=b.mask, w=None, rollout=b.rollout,
    key=KEY, pick=None, agg=None,
  )  # fmt: skip
  for field, how in change.items():
    if how is None:
      args[field] = None
    elif how == 'float':
      src = b.mask if field in ('mask', 'pick') else args[field]
      args[field] = src.astype(np.float32)
    elif how == 'short':
      args[field] = (b.w if field == 'w' else args[field])[:, :-1]
    elif how == 'weights':
      args['w'] = b.w
    elif how == 'seq-mean':
      args[field] = how
    elif how == '1d':
      args['logp'] = b.logp[0]
      args['old'], args['adv'], args['mask'] = b.old[0], b.adv[0], b.mask[0]

  def run(logp):
    return policy.policy_loss(
      name, logp, args['old'], args['adv'], args['mask'],
      is_weights=args['w'], rollout_logp=args['rollout'], key=args['key'],
      clip_cov_pick=args['pick'], agg=args['agg'],
      knobs=policy.check_knobs(KNOBS.get(name, {})),
    )  # fmt: skip

  with pytest.raises(ValueError, match=match):
    run(args['logp'])
  with pytest.raises(ValueError, match=match):  # raised while tracing
    jax.jit(run)(args['logp'])


def test_gpg_needs_no_old_logp_and_rollout_losses_no_old():
  b = make_batch(22)
  policy.policy_loss('gpg', b.logp, None, b.adv, b.mask)
  for name in ('rollout_is', 'prime'):
    policy.policy_loss(
      name, b.logp, None, b.adv, b.mask, rollout_logp=b.rollout
    )


def test_d10_clip_cov_draw_comes_from_the_jax_key():
  """D10: clip_cov's random exemption is drawn from an explicit JAX PRNG key
  (torch uses its global randperm): the same key reproduces the loss
  exactly under jit, and the draw is a pure function of the key."""
  rng = np.random.default_rng(0)
  b, t = 4, 64
  logp = rng.normal(-1, 0.3, (b, t)).astype(np.float32)
  old = logp - rng.normal(0, 0.3, (b, t)).astype(np.float32)
  adv = rng.normal(0, 3, (b, t)).astype(np.float32)
  mask = np.ones((b, t), bool)
  knobs = policy.PolicyKnobs(
    clip_cov_ratio=0.05, clip_cov_lb=-1e9, clip_cov_ub=1e9
  )

  @jax.jit
  def grad(key):
    return jax.grad(
      lambda x: policy.policy_loss(
        'clip_cov', x, old, adv, mask, key=key, knobs=knobs
      )[0]
    )(logp)

  g0, g0_again = grad(jax.random.key(7)), grad(jax.random.key(7))
  np.testing.assert_array_equal(g0, g0_again)
  exempt = [np.asarray(grad(jax.random.key(s)) == 0) for s in range(4)]
  assert any((e != exempt[0]).any() for e in exempt[1:])
  with pytest.raises(ValueError, match='key'):
    policy.policy_loss('clip_cov', logp, old, adv, mask, knobs=knobs)
