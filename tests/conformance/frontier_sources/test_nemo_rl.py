"""NeMo-RL sequence log-prob-error masking (`frontier/nemo_rl`, `b59165262`,
PR #3671) against `seq_error.seq_logprob_error_mask`.

NeMo sees `[B, T+1]` arrays with a prompt column 0, which it drops; the
trainer log-probs are `prev_logprobs` (π_old), the engine's are
`generation_logprobs` (μ). Metric names map `seq_mult_prob_error_*` →
`*_seq_mult_prob_error` and `masked_correct_pct` → `masked_correct_fraction`
(it is a fraction in NeMo too). `sc_reduce/*` replays the single
controller's three 4-row chunks with `reduce_seq_error_metrics`, which must
equal both NeMo's reduction and one call on the whole batch.

The same goldens go through `rollout_correction` too, the config path a user
takes (`correction.rs='seq_mean_mpe'`, `rs_bounds=<threshold>`, NeMo's
`null` threshold as a bound no error reaches). Metric names there: NeMo
`{max,mean,min}_seq_mult_prob_error` → `rollout_rs_seq_mean_mpe_seq_{max,
mean,min}`, `..._after_mask` → `..._kept_seq_{max,mean,min}`,
`masked_correct_pct` → `..._masked_correct_fraction`, `num_masked_seqs` →
the non-empty rows the output mask drops (`seq_masked_fraction` × the
non-empty rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.losses import correction as corr
from jaxcorr.losses.correction import seq_error
from tests.helpers import golden_data as gd

FW = 'frontier/nemo_rl'
STATS = ('max', 'mean', 'min')
P = 'rollout_corr/rollout_rs_seq_mean_mpe_'
NO_MASK = 1e9  # NeMo's null threshold: no error reaches it


def _call(kw, rows=slice(None)):
  return seq_error.seq_logprob_error_mask(
    jnp.asarray(kw['prev_logprobs'][rows, 1:]),
    jnp.asarray(kw['generation_logprobs'][rows, 1:]),
    jnp.asarray(kw['token_mask'][rows, 1:] > 0),
    jnp.asarray(kw['sample_mask'][rows] > 0),
    jnp.asarray(kw['rewards'][rows]),
    threshold=kw['seq_logprob_error_threshold'],
  )


def _check(got, want, masked_key='num_masked_seqs'):
  for s in STATS:
    for suffix in ('', '_after_mask'):
      np.testing.assert_allclose(
        got[f'seq_mult_prob_error_{s}{suffix}'],
        want[f'{s}_seq_mult_prob_error{suffix}'],
        rtol=1e-5,
      )
  assert int(got['num_masked_seqs']) == want[masked_key]
  np.testing.assert_allclose(
    got['masked_correct_fraction'], want['masked_correct_pct'], rtol=1e-6
  )


@pytest.mark.parametrize('case', gd.case_params(FW, prefix='seq_mask/'))
def test_seq_logprob_error_mask(case):
  gs = gd.load(FW)
  kw = gs.kwargs(case)
  keep, met = _call(kw)
  out = gs.outputs(case)
  np.testing.assert_array_equal(keep, out['sample_mask_after'] > 0)
  _check(met, out['metrics'])


@pytest.mark.parametrize('case', gd.case_params(FW, prefix='sc_reduce/'))
def test_chunked_reduction(case):
  gs = gd.load(FW)
  kw = gs.kwargs(case)
  out = gs.outputs(case)
  parts, keeps = [], []
  for (a, b), rec in zip(kw['chunks'], out['chunk_records'], strict=True):
    keep, met = _call(kw, slice(a, b))
    _check(met, rec, 'num_masked_seqs_by_logprob_error')
    assert float(met['num_valid_seqs_before']) == rec['_num_valid_seqs_before']
    assert float(met['num_valid_seqs_after']) == rec['_num_valid_seqs_after']
    parts.append(met)
    keeps.append(keep)
  np.testing.assert_array_equal(
    np.concatenate(keeps), out['sample_mask_after'] > 0
  )
  reduced = seq_error.reduce_seq_error_metrics(parts)
  _check(reduced, out['step_metrics'], 'num_masked_seqs_by_logprob_error')
  whole = _call(kw)[1]
  for k, v in reduced.items():
    np.testing.assert_allclose(v, whole[k], rtol=1e-5, err_msg=k)


def test_padding_invariance_jit_and_threshold_check():
  gs = gd.load(FW)
  kw = gs.kwargs(gs.case('seq_mask/thr1.1/ones'))
  keep, met = _call(kw)
  junk = dict(kw)
  tm = kw['token_mask'] > 0
  for k in ('prev_logprobs', 'generation_logprobs'):
    junk[k] = np.where(tm, kw[k], np.float32(np.nan))
  arrays = {k: v for k, v in junk.items() if k != 'seq_logprob_error_threshold'}
  fn = jax.jit(lambda a: _call({**a, 'seq_logprob_error_threshold': 1.1}))
  keep2, met2 = fn(arrays)
  np.testing.assert_array_equal(keep, keep2)
  for k in met:
    np.testing.assert_allclose(met[k], met2[k], rtol=1e-6, err_msg=k)
  with pytest.raises(ValueError, match='threshold'):
    _call({**kw, 'seq_logprob_error_threshold': 'high'})


def _inputs(kw):
  """NeMo's `[B, T+1]` arrays (prompt column 0) → jaxcorr's `[B, T]`; a
  row outside `sample_mask` has no valid token."""
  sample = kw['sample_mask'] > 0
  mask = (kw['token_mask'][:, 1:] > 0) & sample[:, None]
  return (
    jnp.asarray(kw['prev_logprobs'][:, 1:]),
    jnp.asarray(kw['generation_logprobs'][:, 1:]),
    jnp.asarray(mask),
    jnp.asarray(kw['rewards'], jnp.float32),
  )


@pytest.mark.parametrize('case', gd.case_params(FW, prefix='seq_mask/'))
def test_config_path_reproduces_nemo(case):
  gs = gd.load(FW)
  kw = gs.kwargs(case)
  want = gs.outputs(case)
  train, roll, mask, reward = _inputs(kw)
  threshold = kw['seq_logprob_error_threshold']
  threshold = NO_MASK if threshold is None else threshold
  out = corr.rollout_correction(
    train,
    roll,
    mask,
    corr.CorrectionConfig(rs='seq_mean_mpe', rs_bounds=threshold),
    seq_reward=reward,
  )
  mask, got_mask = np.asarray(mask), np.asarray(out.mask)
  nonempty = mask.any(-1)
  kept = got_mask.any(-1)
  after = want['sample_mask_after'] > 0
  # A row is kept or dropped whole; NeMo keeps empty rows (error 0).
  np.testing.assert_array_equal(got_mask, mask & kept[:, None])
  np.testing.assert_array_equal(kept, after & nonempty)
  np.testing.assert_array_equal(out.weights, got_mask.astype(np.float32))
  m = want['metrics']
  for s in ('max', 'mean', 'min'):
    np.testing.assert_allclose(
      out.metrics[f'{P}seq_{s}'], m[f'{s}_seq_mult_prob_error'], rtol=1e-5
    )
    np.testing.assert_allclose(
      out.metrics[f'{P}kept_seq_{s}'],
      m[f'{s}_seq_mult_prob_error_after_mask'],
      rtol=1e-5,
    )
  dropped = int(np.sum(nonempty & ~kept))
  assert dropped == m['num_masked_seqs']
  frac = float(out.metrics[P + 'seq_masked_fraction'])
  assert round(frac * nonempty.sum()) == m['num_masked_seqs']
  np.testing.assert_allclose(
    out.metrics[P + 'masked_correct_fraction'],
    m['masked_correct_pct'],
    rtol=1e-6,
  )
