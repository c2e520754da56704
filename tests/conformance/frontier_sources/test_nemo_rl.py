"""NeMo-RL sequence log-prob-error masking (`frontier/nemo_rl`, `b59165262`,
PR #3671) against `correction_reject.seq_logprob_error_mask`.

NeMo sees `[B, T+1]` arrays with a prompt column 0, which it drops; the
trainer log-probs are `prev_logprobs` (π_old), the engine's are
`generation_logprobs` (μ). Metric names map `seq_mult_prob_error_*` →
`*_seq_mult_prob_error` and `masked_correct_pct` → `masked_correct_fraction`
(it is a fraction in NeMo too). `sc_reduce/*` replays the single
controller's three 4-row chunks with `reduce_seq_error_metrics`, which must
equal both NeMo's reduction and one call on the whole batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.losses import correction_reject as cr
from tests.helpers import golden_data as gd

FW = 'frontier/nemo_rl'
STATS = ('max', 'mean', 'min')


def _call(kw, rows=slice(None)):
  return cr.seq_logprob_error_mask(
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
  reduced = cr.reduce_seq_error_metrics(parts)
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
