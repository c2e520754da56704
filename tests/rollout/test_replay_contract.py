"""The sampling-mask replay contract (`logprob_mode='replay'`): with
identical weights the replayed ratio is exactly one where the full-vocabulary
one is biased by the kept mass; capped kept sets stay consistent and are
counted; the gradient ignores set membership and jit equals eager; the kept
set's validation rules; the trainer's chunked path from hidden states equals
the logits path. Against slime's goldens:
tests/conformance/frontier_sources/test_slime_replay.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr import sampling
from jaxcorr.model import logprobs as lp_lib
from jaxcorr.rollout import kept_set as ks
from jaxcorr.rollout import validate
from tests.helpers import rollout_testing

replay = jax.jit(lp_lib.replay_logprobs)


@pytest.fixture(scope='module')
def nucleus():
  """64 tokens sampled at top_p = 0.8 over V = 512, and their kept sets."""
  k1, k2 = jax.random.split(jax.random.key(0))
  logits = 2.0 * jax.random.normal(k1, (64, 512))
  keys = jax.random.split(k2, 64)
  y, _, logp_trunc = sampling.sample(keys, logits, 1.0, 0, 0.8, 0.0)
  kept = ks.kept_set(logits, capacity=512, top_p=0.8)
  return logits, y, logp_trunc, kept


def test_identical_weights_replay_ratio_is_one_full_is_biased(nucleus):
  """Same weights on both sides, top_p = 0.8: the engine samples from the
  renormalised nucleus. Replay: trainer log-prob over the replayed set vs
  the engine's log-prob of what it sampled → ratio exactly 1. 'full': the
  trainer's full-vocabulary log-prob vs the same engine value → ratio Z_t,
  the kept mass (biased low)."""
  logits, y, logp_trunc, kept = nucleus
  assert not bool(jnp.any(kept.capped))
  trainer, log_mass = replay(logits, y, kept.ids, kept.count)
  # The engine reports its log-prob with the same function on its logits
  # (identical weights here): bitwise the trainer's value, ratio exactly 1.
  engine, _ = replay(logits, y, kept.ids, kept.count)
  np.testing.assert_array_equal(trainer, engine)
  # Against the sampler's own truncated log-prob (other arithmetic): 1e-6.
  ratio_replay = jnp.exp(trainer - logp_trunc)
  np.testing.assert_allclose(ratio_replay, 1.0, rtol=0, atol=1e-6)
  full = trainer + log_mass
  ratio_full = jnp.exp(full - logp_trunc)
  mean_full = float(jnp.mean(ratio_full))
  print(
    f'\nidentical weights, top_p=0.8: replay ratio mean '
    f'{float(jnp.mean(ratio_replay)):.7f} max |log r| '
    f'{float(jnp.max(jnp.abs(trainer - logp_trunc))):.2e}; full ratio mean '
    f'{mean_full:.4f} (min {float(jnp.min(ratio_full)):.4f})'
  )
  assert mean_full < 0.9  # the kept mass: ≈ top_p or a bit above
  np.testing.assert_allclose(ratio_full, jnp.exp(log_mass), rtol=1e-5)


def test_capped_sets_stay_consistent_and_are_counted(nucleus):
  """A set wider than C keeps its C most probable ids on both sides: the
  ratio is still 1 with identical weights, and the metric counts it."""
  logits, y, _, _ = nucleus
  kept = ks.kept_set(logits, capacity=8, top_p=0.99)
  assert bool(jnp.all(kept.capped)) and bool(jnp.all(kept.count == 8))
  eng, _ = replay(logits, y, kept.ids, kept.count)
  trn, log_mass = replay(logits, y, kept.ids, kept.count)
  np.testing.assert_array_equal(eng, trn)
  mask = jnp.ones(y.shape, bool)
  met = ks.replay_metrics(log_mass, kept, mask)
  assert float(met['replay/capped_fraction']) == 1.0
  assert float(met['replay/set_size_max']) == 8.0
  assert (
    0
    < float(met['replay/kept_mass_min'])
    <= float(met['replay/kept_mass_mean'])
    <= 1
  )


def test_replay_gradient_ignores_membership_and_jit_matches_eager(nucleus):
  logits, y, _, kept = nucleus
  logits, y = logits[:8], y[:8]
  kept = jax.tree.map(lambda x: x[:8], kept)

  def f(lg):
    return jnp.sum(lp_lib.replay_logprobs(lg, y, kept.ids, kept.count)[0])

  g = jax.jit(jax.grad(f))(logits)
  member = rollout_testing.kept_mask(kept, 512) | jax.nn.one_hot(
    y, 512, dtype=bool
  )
  assert float(jnp.max(jnp.abs(jnp.where(member, 0, g)))) == 0.0
  np.testing.assert_allclose(jax.jit(f)(logits), f(logits), rtol=1e-6)  # eager


def test_validation_rules(nucleus):
  logits, y, _, kept = nucleus
  ids = np.asarray(kept.ids)[None, :4]
  count = np.asarray(kept.count)[None, :4]
  capped = np.asarray(kept.capped)[None, :4]
  tok = np.asarray(y)[None, :4]
  mask = np.ones((1, 4), bool)
  args = dict(response_tokens=tok, response_mask=mask, vocab_size=512)
  validate.validate_kept_set(ids, count, capped, **args)
  bad = ids.copy()
  bad[0, 0, 0] = 512  # out of range (slime drops it silently)
  with pytest.raises(ValueError, match=r'kept_ids.*\[0, 512\)'):
    validate.validate_kept_set(bad, count, capped, **args)
  dup = ids.copy()
  dup[0, 0, 1] = dup[0, 0, 0]
  if count[0, 0] >= 2:
    with pytest.raises(ValueError, match='distinct'):
      validate.validate_kept_set(dup, count, capped, **args)
  other = tok.copy()
  other[0, 0] = next(i for i in range(512) if i not in set(ids[0, 0].tolist()))
  with pytest.raises(ValueError, match='sampled token'):
    validate.validate_kept_set(
      ids, count, capped, **{**args, 'response_tokens': other}
    )
  with pytest.raises(ValueError, match='kept_count'):
    validate.validate_kept_set(ids, np.zeros_like(count), capped, **args)
  with pytest.raises(ValueError, match='max_capped_fraction'):
    full_count = np.full_like(count, ids.shape[-1])
    full_ids = np.asarray(
      ks.kept_set(logits[:4], capacity=ids.shape[-1], top_p=1.0).ids
    )[None]
    validate.validate_kept_set(
      full_ids, full_count, np.ones_like(capped), **args
    )


def test_chunked_replay_from_hidden_matches_logits_path():
  """`logprobs_from_hidden(kept_ids=..., kept_count=...)` (the trainer's
  memory-bounded path) equals `replay_logprobs` on the full logits, values
  and gradients, with a chunk size that does not divide T."""
  kh, kw, kl = jax.random.split(jax.random.key(1), 3)
  b, t, d, v = 2, 7, 8, 32
  hidden = jax.random.normal(kh, (b, t, d))
  head = jax.random.normal(kw, (v, d)) * 0.5
  y = jax.random.randint(kl, (b, t), 0, v)
  logits = jnp.einsum('btd,vd->btv', hidden, head) / 0.7
  kept = ks.kept_set(logits * 0.7, capacity=6, temperature=0.7, top_p=0.9)

  def chunked(h):
    logp, mass = lp_lib.logprobs_from_hidden(
      h, head, y, temperature=0.7, chunk_size=3, kept_ids=kept.ids,
      kept_count=kept.count, return_kept_mass=True,
    )  # fmt: skip
    return jnp.sum(logp), (logp, mass)

  def direct(h):
    lg = jnp.einsum('btd,vd->btv', h, head)
    logp, mass = lp_lib.replay_logprobs(
      lg, y, kept.ids, kept.count, temperature=0.7
    )
    return jnp.sum(logp), (logp, mass)

  (_, (a, ma)), ga = jax.jit(jax.value_and_grad(chunked, has_aux=True))(hidden)
  (_, (b_, mb)), gb = jax.jit(jax.value_and_grad(direct, has_aux=True))(hidden)
  np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ma, mb, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ga, gb, rtol=1e-4, atol=1e-5)
  with pytest.raises(ValueError, match='kept_count'):
    lp_lib.logprobs_from_hidden(hidden, head, y, kept_ids=kept.ids)
