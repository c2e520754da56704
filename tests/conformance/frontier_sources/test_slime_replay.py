"""Sampling-mask replay against slime (`frontier/slime_frontier`, `8f5e21519`,
PR #2102); the replay contract itself: tests/rollout/test_replay_contract.py.

slime's kept sets are ragged (`top_p_token_ids` + `top_p_token_offsets` per
sample); `rollout_testing.from_ragged` turns them into jaxcorr's fixed-width
`KeptSet` (C = V, so nothing is capped and the cases of one V share their
compiles). The
packed row of response token r of sample i is `offset_i + prompt_i − 1 + r`
(slime's `response_rows`). `replay_logprobs` on those rows must give slime's
log-probs, its gradient w.r.t. the packed logits, and, on the engine's
logits, the engine-side renormalised log-probs.

Divergences (docs/correction.md §4): D27 (slime silently drops ids outside
[0, V), ignores duplicates, force-keeps a missing sampled token and falls
back to the full vocabulary where offsets are short; jaxcorr's validation
rejects each), D28 (slime replays only when top_p < 1; jaxcorr replays
whenever `logprob_mode='replay'`, top-k and min-p truncate too).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.model import logprobs as lp_lib
from jaxcorr.rollout import kept_set as ks
from jaxcorr.rollout import validate
from tests.helpers import golden_data as gd
from tests.helpers import rollout_testing

FW = 'frontier/slime_frontier'
ATOL = 1e-6


def layout(kw):
  """(rows [N], targets [N], per-sample slices) of the response tokens."""
  rows, targets, spans, off = [], [], [], 0
  for tok, total, resp in zip(
    kw['unconcat_tokens'],
    kw['total_lengths'],
    kw['response_lengths'],
    strict=True,
  ):
    prompt = total - resp
    start = len(rows)
    for r in range(resp):
      rows.append(off + prompt - 1 + r)
      targets.append(int(tok[prompt + r]))
    spans.append(slice(start, len(rows)))
    off += total
  return np.asarray(rows, np.int64), np.asarray(targets, np.int32), spans


def kept_from_slime(kw, v):
  """slime's ragged kept sets → KeptSet arrays [N, C] + `has_data` [N].

  Short offsets (`edge/short_offsets`) are a slime-only leniency (D27):
  the tokens without data are marked and filled with a placeholder set.
  """
  ids_l, offs_l = kw['top_p_token_ids'], kw['top_p_token_offsets']
  width = v  # one width per V: the jitted replay below compiles once per V
  ids, count, has = [], [], []
  for i, resp in enumerate(kw['response_lengths']):
    offs = np.asarray(offs_l[i])
    n_data = max(len(offs) - 1, 0)
    if n_data < resp:
      with pytest.raises(ValueError, match='offsets'):
        rollout_testing.from_ragged(ids_l[i], offs, resp, width)
      pad = np.full(resp - n_data, offs[-1] if len(offs) else 0)
      offs = np.concatenate([offs if len(offs) else [0], pad])
    a, c, capped = rollout_testing.from_ragged(ids_l[i], offs, resp, width)
    assert not capped.any()
    ids.append(a)
    count.append(c)
    has.append(np.arange(resp) < n_data)
  return np.concatenate(ids), np.concatenate(count), np.concatenate(has)


def _per_sample(x, spans):
  return [np.asarray(x)[s] for s in spans]


def _replay_case(case):
  gs = gd.load(FW)
  kw = gs.kwargs(case)
  logits = kw['logits'][0]
  v = logits.shape[-1]
  tau = kw['args']['rollout_temperature']
  rows, y, spans = layout(kw)
  out = gs.outputs(case)
  np.testing.assert_array_equal(rows, out['response_rows'])
  return gs, kw, logits, v, tau, rows, y, spans, out


E2E = gd.case_params(FW, prefix='e2e/') + gd.case_params(FW, prefix='edge/')
# Jitted once at module level, τ traced: the golden cases differ in data and
# τ, and share a compile per vocabulary size.
replay = jax.jit(lp_lib.replay_logprobs)


@jax.jit
def replay_value_and_grad(logits, rows, y, ids, count, has, tau):
  """d(Σ replayed logp)/d logits, slime's fallback on rows without data."""

  def total(logits):
    logp, log_mass = lp_lib.replay_logprobs(
      logits[rows], y, ids, count, temperature=tau
    )
    # slime: rows without kept-set data keep the full vocabulary (D27).
    logp = jnp.where(has, logp, logp + log_mass)
    return jnp.sum(logp), (logp, log_mass)

  return jax.value_and_grad(total, has_aux=True)(logits)


@jax.jit
def clp_value_and_grad(logits, y, ids, count):
  def total(logits):
    logp, _ = lp_lib.replay_logprobs(logits, y, ids, count)
    return jnp.sum(logp), logp

  return jax.value_and_grad(total, has_aux=True)(logits)


@pytest.mark.parametrize('case', E2E)
def test_replay_matches_slime(case):
  _, kw, logits, v, tau, rows, y, _, out = _replay_case(case)
  full_want = np.concatenate(out['unmasked_log_probs'])
  want = np.concatenate(out['log_probs'])
  if not kw['replay_active']:
    # D28: slime does not replay without top-p (here top-k only): its
    # log-probs are the full ones. jaxcorr replays the engine's kept set.
    np.testing.assert_allclose(want, full_want, atol=ATOL)
    es = kw['engine_sampling']
    kept = ks.kept_set(
      jnp.asarray(kw['engine_logits'][rows]), capacity=v, temperature=tau,
      top_k=es['top_k'] or 0, top_p=es['top_p'], min_p=es['min_p'],
    )  # fmt: skip
    got, log_mass = replay(
      jnp.asarray(logits[rows]), jnp.asarray(y), kept.ids, kept.count,
      temperature=jnp.float32(tau),
    )  # fmt: skip
    np.testing.assert_allclose(got + log_mass, full_want, atol=ATOL)
    if es['top_k']:  # the kept-mass bias slime keeps under top-k alone
      assert float(jnp.min(log_mass)) < -0.01
    return
  ids, count, has = kept_from_slime(kw, v)
  (_, (logp, log_mass)), grad = replay_value_and_grad(
    jnp.asarray(logits), jnp.asarray(rows), jnp.asarray(y), jnp.asarray(ids),
    jnp.asarray(count), jnp.asarray(has), jnp.float32(tau),
  )  # fmt: skip
  np.testing.assert_allclose(logp, want, atol=ATOL)
  np.testing.assert_allclose(
    logp + jnp.where(has, log_mass, 0), full_want, atol=ATOL
  )
  np.testing.assert_allclose(grad, out['grad_logits'][0], atol=ATOL)
  # keep_mask: slime's [Σ L, V] membership before the target is added.
  mask = np.ones(logits.shape, bool)
  member = np.asarray(
    rollout_testing.kept_mask(
      ks.KeptSet(jnp.asarray(ids), jnp.asarray(count), None), v
    )
  )
  mask[rows[has]] = member[has]
  np.testing.assert_array_equal(mask, out['keep_mask'])
  # The engine side: the same function on the engine's logits.
  eng, _ = replay(
    jnp.asarray(kw['engine_logits'][rows]), jnp.asarray(y), jnp.asarray(ids),
    jnp.asarray(count), temperature=jnp.float32(tau),
  )  # fmt: skip
  eng_want = np.concatenate(out['engine_renorm_log_probs'])
  # The SGLang patch treats an empty set as "no data" (full vocabulary); in
  # jaxcorr an empty kept set is invalid (the token was drawn from it).
  some = has & (count > 0)
  np.testing.assert_allclose(np.asarray(eng)[some], eng_want[some], atol=ATOL)


@pytest.mark.parametrize('case', gd.case_params(FW, prefix='clp/'))
def test_compute_log_probs(case):
  """slime's `compute_log_probs(logits, tokens, keep_mask)` on `[N, V]`;
  a `[N, V]` mask is the kept set with C = V."""
  gs = gd.load(FW)
  kw = gs.kwargs(case)
  logits, y = kw['logits'], kw['tokens'].reshape(-1).astype(np.int32)
  n, v = logits.shape
  keep = kw.get('keep_mask')
  if keep is None:
    keep = np.ones((n, v), bool)
  order = np.argsort(~keep, axis=-1, kind='stable').astype(np.int32)
  count = keep.sum(-1).astype(np.int32)
  ids = np.where(np.arange(v) < count[:, None], order, -1).astype(np.int32)

  (_, logp), grad = clp_value_and_grad(
    jnp.asarray(logits), jnp.asarray(y), jnp.asarray(ids), jnp.asarray(count)
  )
  out = gs.outputs(case)
  np.testing.assert_allclose(logp, out['log_probs'].reshape(-1), atol=ATOL)
  np.testing.assert_allclose(grad, out['grad_logits'], atol=ATOL)


@pytest.mark.parametrize('case', gd.case_params(FW, prefix='error/'))
def test_missing_kept_set_is_an_error(case):
  """slime: `rollout_top_p != 1` without kept sets raises; jaxcorr: every
  `logprob_mode='replay'` batch must carry them (validate.py, rule 9)."""
  assert gd.load(FW).error(case)['type'] == 'ValueError'
  mask = np.ones((1, 2), bool)
  with pytest.raises(ValueError, match='kept_ids'):
    validate.validate_kept_set(
      np.zeros((1, 2), np.int32), np.ones((1, 2), np.int32),
      np.zeros((1, 2), bool), np.zeros((1, 2), np.int32), mask, 8,
    )  # fmt: skip


def test_engine_kept_set_matches_slime_selection():
  """`kept_set` on the engine logits reproduces the SGLang patch's kept sets
  for top-p and min-p (the sets slime replays)."""
  gs = gd.load(FW)
  for cid in ('e2e/p/p0.9/V128_t1.0', 'e2e/p/p0.7/V64_t1.3',
              'e2e/p/p0.1/V128_t1.0', 'e2e/minp/minp0.1_p0.95/V128_t1.0'):  # fmt: skip
    case = gs.case(cid)
    kw = gs.kwargs(case)
    rows, _, _ = layout(kw)
    es = kw['engine_sampling']
    v = kw['logits'].shape[-1]
    kept = ks.kept_set(
      jnp.asarray(kw['engine_logits'][rows]), capacity=v,
      temperature=es['temperature'], top_k=es['top_k'] or 0,
      top_p=es['top_p'], min_p=es['min_p'],
    )  # fmt: skip
    want = gs.outputs(case)['keep_mask'][rows]
    np.testing.assert_array_equal(
      rollout_testing.kept_mask(kept, v), want, err_msg=cid
    )


def test_d30_top_p_after_top_k_renormalises():
  """With top-k and top-p both on, jaxcorr's sampler (and so its kept set)
  applies top-p to the renormalised top-k survivors (sampling.py); the
  SGLang patch accumulates the full-vocabulary probabilities. jaxcorr's set
  is then a subset of SGLang's, equal when top-k binds first."""
  gs = gd.load(FW)
  for cid, equal in (
    ('e2e/kp/k20_p0.9/V256_t0.7', False),
    ('e2e/kp/k5_p0.95/V512_t1.0', True),
  ):
    kw = gs.kwargs(gs.case(cid))
    rows, _, _ = layout(kw)
    es = kw['engine_sampling']
    v = kw['logits'].shape[-1]
    kept = ks.kept_set(
      jnp.asarray(kw['engine_logits'][rows]), capacity=v,
      temperature=es['temperature'], top_k=es['top_k'], top_p=es['top_p'],
    )  # fmt: skip
    got = np.asarray(rollout_testing.kept_mask(kept, v))
    want = gs.outputs(gs.case(cid))['keep_mask'][rows]
    assert not (got & ~want).any(), cid
    assert np.array_equal(got, want) == equal, cid
