"""Aggregation and KL estimators: goldens, divergences, contracts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.losses import aggregate as agg_lib
from jaxcorr.losses import kl as kl_lib
from tests.helpers import golden_data as gd

TOL = dict(rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------ verl agg_loss


@pytest.mark.parametrize('case', gd.case_params('verl', group='agg_loss'))
def test_verl_agg_loss(case):
  gs = gd.load('verl')
  kw = gs.kwargs(case)
  mode = kw['loss_agg_mode']
  mask = kw['loss_mask'].astype(bool)
  err = gs.error(case)
  if mode == 'bad-mode':
    assert err is not None
    with pytest.raises(ValueError, match='allowed: token_mean'):
      agg_lib.aggregate(kw['loss_mat'], mask, mode)
    return
  dp = kw.get('dp_size', 1)
  if err is not None:
    # verl needs its global counts when dp > 1; jaxcorr's arrays are global
    # under jit, so there is no dp factor to forget (spec README, conventions
    # 7): the same call is simply the local aggregation.
    assert 'required when dp_size > 1' in err['message']
    local = gs.case(case['id'].replace('dp2_missing_info', 'local'))
    got = agg_lib.aggregate(kw['loss_mat'], mask, mode)
    np.testing.assert_allclose(got, gs.outputs(local)['loss'], **TOL)
    return
  # verl scales per-rank losses by dp and divides by global counts; the
  # same per-rank value is jaxcorr's loss with counts divided by dp.
  num_tokens = kw.get('batch_num_tokens')
  num_seqs = kw.get('global_batch_size')
  got = agg_lib.aggregate(
    kw['loss_mat'],
    mask,
    mode,
    num_tokens=None if num_tokens is None else num_tokens / dp,
    num_seqs=None if num_seqs is None else num_seqs / dp,
    norm=kw.get('loss_scale_factor'),
  )
  if mode == 'token-sum':
    got = got * dp  # verl multiplies token-sum by dp; jaxcorr does not
  want = gs.outputs(case)['loss']
  np.testing.assert_allclose(got, want, **TOL)


# ------------------------------------------------------------ skyrl reduction


def _skyrl_reduced(case, adv, mask):
  """jaxcorr's aggregate of A under SkyRL's loss_reduction."""
  gs = gd.load('skyrl')
  kw = gs.kwargs(case)
  mode = kw['loss_reduction']
  if mode == 'token_mean':
    return agg_lib.aggregate(adv, mask, 'token_mean')
  if mode == 'sequence_mean':
    return agg_lib.aggregate(adv, mask, 'seq_mean_token_mean')
  if mode == 'seq_mean_token_sum_norm':
    return agg_lib.aggregate(
      adv, mask, 'seq_mean_token_sum_norm', norm=kw['max_seq_len']
    )
  if mode == 'token_mean_legacy':
    # Mean over micro-batches of each micro-batch's token mean.
    mbs = kw['micro_batch_size']
    parts = [
      agg_lib.aggregate(adv[i : i + mbs], mask[i : i + mbs], 'token_mean')
      for i in range(0, adv.shape[0], mbs)
    ]
    return sum(parts) / len(parts)
  if mode == 'prompt_mean':
    parts = [
      agg_lib.aggregate(adv[a:b], mask[a:b], 'token_mean')
      for a, b in kw['prompt_boundaries']
    ]
    return sum(parts) / len(parts)
  raise AssertionError(mode)


@pytest.mark.parametrize('case', gd.case_params('skyrl', group='reduction'))
def test_skyrl_reduction(case):
  # SkyRL folds the reduction into the advantages: Σ scaled·m is the
  # reduced loss of the per-token values A.
  gs = gd.load('skyrl')
  kw = gs.kwargs(case)
  mask = kw['loss_mask'].astype(bool)
  want = np.sum(gs.outputs(case)['advantages'] * mask)
  got = _skyrl_reduced(case, kw['advantages'], mask)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------- aggregation API


def _rand(shape, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=shape).astype(np.float32)
  lengths = rng.integers(0, shape[1] + 1, size=shape[0])
  lengths[0] = shape[1]
  mask = np.arange(shape[1])[None] < lengths[:, None]
  return x, mask


def test_aliases_equal_canonical():
  x, mask = _rand((5, 7))
  for mode in agg_lib.MODES:
    a = agg_lib.aggregate(x, mask, mode)
    b = agg_lib.aggregate(x, mask, mode.replace('_', '-'))
    assert a == b


def test_unknown_mode_lists_allowed():
  x, mask = _rand((2, 3))
  with pytest.raises(ValueError, match=r"agg='mean'.*seq_mean_token_mean"):
    agg_lib.aggregate(x, mask, 'mean')


def test_trace_time_errors():
  x, mask = _rand((2, 3))
  with pytest.raises(ValueError, match='bool'):
    agg_lib.aggregate(x, mask.astype(np.float32), 'token_mean')
  with pytest.raises(ValueError, match='shape mismatch'):
    agg_lib.aggregate(x, mask[:, :2], 'token_mean')
  with pytest.raises(ValueError, match='norm must be > 0'):
    agg_lib.aggregate(x, mask, 'seq_mean_token_sum_norm', norm=0)


@pytest.mark.parametrize('mode', agg_lib.MODES)
def test_all_masked_is_exact_zero(mode):
  x = jnp.full((3, 4), jnp.nan)
  mask = jnp.zeros((3, 4), bool)
  val, grad = jax.value_and_grad(lambda v: agg_lib.aggregate(v, mask, mode))(x)
  assert val == 0.0
  assert not np.any(np.asarray(grad))


@pytest.mark.parametrize('mode', agg_lib.MODES)
def test_padding_garbage_bitwise(mode):
  x, mask = _rand((6, 9), seed=1)
  dirty = np.where(mask, x, np.float32(np.nan))
  dirty[~mask & (np.arange(9) % 2 == 0)] = np.inf

  def f(v):
    return agg_lib.aggregate(v, mask, mode, norm=16.0)

  v1, g1 = jax.value_and_grad(f)(x)
  v2, g2 = jax.value_and_grad(f)(dirty)
  assert np.asarray(v1).tobytes() == np.asarray(v2).tobytes()
  assert np.asarray(g1).tobytes() == np.asarray(g2).tobytes()


@pytest.mark.parametrize('mode', agg_lib.MODES)
def test_micro_batches_with_global_counts_match_full_batch(mode):
  x, mask = _rand((8, 11), seed=2)
  n_tok = mask.sum()
  n_seq = (mask.sum(-1) > 0).sum()

  def full(v):
    return agg_lib.aggregate(v, mask, mode, norm=11.0)

  def split(v):
    return sum(
      agg_lib.aggregate(
        v[i : i + 2],
        mask[i : i + 2],
        mode,
        num_tokens=n_tok,
        num_seqs=n_seq,
        norm=11.0,
      )
      for i in range(0, 8, 2)
    )

  def terms(v):
    nums, cnts = zip(
      *(
        agg_lib.aggregate_terms(v[i : i + 2], mask[i : i + 2], mode, norm=11.0)
        for i in range(0, 8, 2)
      )
    )
    return agg_lib.finalize(sum(nums), sum(cnts), mode)

  v0, g0 = jax.value_and_grad(full)(x)
  for fn in (split, terms):
    v, g = jax.value_and_grad(fn)(x)
    np.testing.assert_allclose(v, v0, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(g, g0, rtol=1e-6, atol=1e-7)


def test_bf16_is_upcast_and_f64_kept():
  x, mask = _rand((3, 5))
  out = agg_lib.aggregate(jnp.asarray(x, jnp.bfloat16), mask, 'token_mean')
  assert out.dtype == jnp.float32
  with jax.enable_x64(True):
    out = agg_lib.aggregate(x.astype(np.float64), mask, 'token_mean')
    assert out.dtype == jnp.float64


# ------------------------------------------------------------------ verl kl


@pytest.mark.parametrize('case', gd.case_params('verl', group='kl'))
def test_verl_kl_penalty(case):
  gs = gd.load('verl')
  kw = gs.kwargs(case)
  est = kw['kl_penalty']
  if gs.error(case) is not None:
    with pytest.raises(ValueError, match='allowed: k1'):
      kl_lib.kl_penalty(kw['logprob'], kw['ref_logprob'], est)
    return
  mask = gs.dataset()['response_mask'].astype(bool)
  out = gs.outputs(case)

  def masked_sum(lp):
    return jnp.sum(kl_lib.kl_penalty(lp, kw['ref_logprob'], est, mask=mask))

  grad = jax.grad(masked_sum)(kw['logprob'])
  got = kl_lib.kl_penalty(kw['logprob'], kw['ref_logprob'], est, mask=mask)
  np.testing.assert_allclose(
    np.where(mask, got, 0), np.where(mask, out['kl'], 0), **TOL
  )
  np.testing.assert_allclose(grad, out['grad_logprob_of_masked_sum'], **TOL)
  # D13: zero outside the mask (verl leaves values in padding).
  assert not np.any(np.asarray(got)[~mask])


# ----------------------------------------------------------------- skyrl kl


@pytest.mark.parametrize('case', gd.case_params('skyrl', group='kl'))
def test_skyrl_compute_approx_kl(case):
  gs = gd.load('skyrl')
  kw = gs.kwargs(case)
  want = gs.outputs(case)['kld']
  mask = kw.get('loss_mask')
  if mask is None:
    # Unmasked: the caller passes clean inputs; compare on the valid tokens.
    valid = gs.dataset()['loss_mask'].astype(bool)
    got = kl_lib.kl_penalty(
      kw['log_probs'], kw['log_probs_base'], kw['kl_estimator_type']
    )
    np.testing.assert_allclose(np.asarray(got)[valid], want[valid], **TOL)
    return
  mask = mask.astype(bool)
  got = kl_lib.kl_penalty(
    kw['log_probs'], kw['log_probs_base'], kw['kl_estimator_type'], mask=mask
  )
  # SkyRL zeroes masked positions (torch.where), so compare everywhere;
  # its inputs hold NaN there in `nan_at_masked_positions`.
  np.testing.assert_allclose(got, want, **TOL)


# ----------------------------------------------------------------- slime kl


def _slime_k3_unclamped(lp, base):
  u = base - lp
  return np.exp(u) - u - 1


@pytest.mark.parametrize('case', gd.case_params('slime', group='kl'))
def test_slime_compute_approx_kl(case):
  gs = gd.load('slime')
  kw = gs.kwargs(case)
  est = kw['kl_loss_type']
  lp, base = kw['log_probs'], kw['log_probs_base']
  want = gs.outputs(case)['kl']
  got = np.asarray(kl_lib.kl_penalty(lp, base, est))
  ratio = kw.get('importance_ratio')
  if ratio is not None:
    # DeepSeek-V3.2 "unbiased KL" weights the estimate by π_θ/π_old; in
    # jaxcorr that is the caller multiplying kl_penalty by the ratio. slime
    # clamps low_var_kl after that product, jaxcorr's clamp comes first.
    got = got * ratio
    if est == 'low_var_kl':
      got = np.clip(_slime_k3_unclamped(lp, base) * ratio, -10, 10)
      assert np.all(np.abs(_slime_k3_unclamped(lp, base)) < 10)
  if est == 'k3':
    # D11: slime's k3 has no clamps; jaxcorr's k3 is low_var_kl. They agree
    # wherever the clamps are inactive, and jaxcorr is bounded elsewhere.
    raw = _slime_k3_unclamped(lp, base)
    active = np.abs(raw) > 10
    np.testing.assert_allclose(got[~active], want[~active], **TOL)
    np.testing.assert_array_equal(got[active], np.clip(raw[active], -10, 10))
    return
  np.testing.assert_allclose(got, want, **TOL)


def test_d11_slime_k3_outliers_are_clamped_in_jaxcorr():
  gs = gd.load('slime')
  kw = gs.kwargs(gs.case('kl/k3/old_vs_rollout_outliers'))
  want = gs.outputs(gs.case('kl/k3/old_vs_rollout_outliers'))['kl']
  got = np.asarray(
    kl_lib.kl_penalty(kw['log_probs'], kw['log_probs_base'], 'k3')
  )
  assert np.max(want) > 10  # slime: unbounded at the ±5 outliers
  assert np.max(got) <= 10  # jaxcorr: low-variance estimator is bounded


# ------------------------------------------------------------- properties


def test_plus_variants_value_and_gradient():
  rng = np.random.default_rng(3)
  lp = rng.normal(size=(4, 6)).astype(np.float32)
  ref = lp + rng.normal(scale=0.5, size=(4, 6)).astype(np.float32)
  mask = rng.random((4, 6)) > 0.2

  def total(est):
    return lambda x: jnp.sum(kl_lib.kl_penalty(x, ref, est, mask=mask))

  g_k2 = jax.grad(total('k2'))(lp)
  for base in ('k1', 'abs', 'k2', 'k3', 'kl', 'mse', 'low_var_kl'):
    v_plus = kl_lib.kl_penalty(lp, ref, base + '+', mask=mask)
    v_base = kl_lib.kl_penalty(lp, ref, base, mask=mask)
    np.testing.assert_allclose(v_plus, v_base, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(jax.grad(total(base + '+'))(lp), g_k2, 1e-6)
  # k2+ and mse+ are k2 itself, value and gradient.
  np.testing.assert_array_equal(
    kl_lib.kl_penalty(lp, ref, 'k2+', mask=mask),
    kl_lib.kl_penalty(lp, ref, 'k2', mask=mask),
  )


@pytest.mark.parametrize('name', ['full', 'k4', 'k2++', '', 'K2'])
def test_unknown_estimators(name):
  with pytest.raises(ValueError, match='not a KL estimator; allowed'):
    kl_lib.kl_penalty(jnp.zeros((1, 2)), jnp.zeros((1, 2)), name)


def test_no_gradient_through_reference():
  lp = jnp.array([[0.1, -0.3]])
  ref = jnp.array([[-0.2, 0.4]])
  for est in ('k1', 'abs', 'k2', 'k3', 'k3+'):
    g = jax.grad(lambda r, e=est: jnp.sum(kl_lib.kl_penalty(lp, r, e)))(ref)
    assert not np.any(np.asarray(g))


def test_k3_extreme_log_ratios_finite_and_bounded():
  lp = jnp.array([[-1e4, 1e4, 0.0, 30.0, -30.0]])
  ref = jnp.zeros_like(lp)
  val, grad = jax.value_and_grad(
    lambda x: jnp.sum(kl_lib.kl_penalty(x, ref, 'k3'))
  )(lp)
  assert np.isfinite(val) and np.all(np.isfinite(grad))
  assert np.all(np.abs(kl_lib.kl_penalty(lp, ref, 'k3')) <= 10)


def test_straight_through_bias_monte_carlo():
  """Averaged pathwise gradients on a 5-token softmax: k2 matches the true
  ∇KL(π_θ‖π_ref), k3 (used as a loss) does not; k3+ behaves like k2."""
  logits = jnp.array([0.3, -0.5, 1.2, 0.0, -1.0])
  ref_logits = jnp.array([-0.2, 0.4, 0.8, -0.6, 0.1])
  ref_lp = jax.nn.log_softmax(ref_logits)

  def true_kl(z):
    lp = jax.nn.log_softmax(z)
    return jnp.sum(jnp.exp(lp) * (lp - ref_lp))

  exact = jax.grad(true_kl)(logits)
  samples = jax.random.categorical(jax.random.key(0), logits, shape=(200_000,))

  def mc_grad(est):
    def loss(z):
      lp = jax.nn.log_softmax(z)[samples]
      return jnp.mean(kl_lib.kl_penalty(lp, ref_lp[samples], est))

    return jax.grad(loss)(logits)

  err = {e: float(jnp.max(jnp.abs(mc_grad(e) - exact))) for e in ('k2', 'k3')}
  scale = float(jnp.max(jnp.abs(exact)))
  assert err['k2'] < 0.02 * scale + 2e-3, err
  assert err['k3'] > 0.1 * scale, err
  np.testing.assert_allclose(mc_grad('k3+'), mc_grad('k2'), rtol=1e-5)


def test_abs_gradient_is_zero_where_logps_agree():
  # torch's |d| differentiates to sign(d) = 0 at d = 0; so must jaxcorr's.
  lp = jnp.array([[0.5, -0.25, 0.0]])
  ref = jnp.array([[0.5, 0.25, -1.0]])
  g = jax.grad(lambda x: jnp.sum(kl_lib.kl_penalty(x, ref, 'abs')))(lp)
  np.testing.assert_array_equal(g, [[0.0, -1.0, 1.0]])
