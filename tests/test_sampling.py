"""`jaxcorr.sampling`: the truncation rule of docs/math/rollout_contract.md §2,
the two log-probs, and that the sampler draws from exactly the distribution
whose log-probs it reports (docs/math/rollout_contract.md §8 test 3)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxcorr import sampling

support = jax.jit(sampling.support)
sample = jax.jit(sampling.sample)


def _keys(n, seed=0):
  return jax.random.split(jax.random.PRNGKey(seed), n)


def test_top_k_keeps_most_probable_and_ties_go_to_lower_id():
  logits = jnp.asarray([[0.0, 2.0, 1.0, 2.0, 1.0, -1.0]])
  np.testing.assert_array_equal(
    support(logits, 1.0, 3), [[False, True, True, True, False, False]]
  )
  np.testing.assert_array_equal(
    support(logits, 1.0, 1), [[False, True, False, False, False, False]]
  )
  assert bool(support(logits, 1.0, 0).all())


def test_top_p_keeps_the_crossing_token_and_at_least_one():
  probs = jnp.asarray([[0.1, 0.5, 0.3, 0.1]])
  logits = jnp.log(probs)
  # Sorted: 0.5, 0.3, 0.1 (id 0), 0.1 (id 3). 0.5 < 0.7 -> the 0.3 crosses.
  np.testing.assert_array_equal(
    support(logits, 1.0, 0, 0.7), [[False, True, True, False]]
  )
  np.testing.assert_array_equal(
    support(logits, 1.0, 0, 0.5), [[False, True, False, False]]
  )
  np.testing.assert_array_equal(
    support(logits, 1.0, 0, 1e-6), [[False, True, False, False]]
  )
  # top-p renormalises over the top-k survivors: {0.5, 0.3} -> 0.625, 0.375.
  np.testing.assert_array_equal(
    support(logits, 1.0, 2, 0.6), [[False, True, False, False]]
  )
  np.testing.assert_array_equal(
    support(logits, 1.0, 2, 0.63), [[False, True, True, False]]
  )


def test_min_p_and_temperature_enter_the_rule():
  logits = jnp.log(jnp.asarray([[0.6, 0.3, 0.1]]))
  np.testing.assert_array_equal(
    support(logits, 1.0, 0, 1.0, 0.4), [[True, True, False]]
  )
  # τ = 3 flattens q: 0.1 now survives min_p = 0.4 (ratio (1/6)^(1/3)).
  np.testing.assert_array_equal(
    support(logits, 3.0, 0, 1.0, 0.4), [[True, True, True]]
  )


def test_parameters_per_row():
  logits = jnp.tile(jnp.log(jnp.asarray([0.4, 0.3, 0.2, 0.1])), (3, 1))
  keep = support(
    logits, jnp.ones(3), jnp.asarray([1, 0, 3]), jnp.asarray([1.0, 0.6, 1.0])
  )
  np.testing.assert_array_equal(
    keep,
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]],
  )


@pytest.mark.parametrize('temperature', [0.6, 1.0, 1.7])
def test_logprob_definitions(temperature):
  logits = jax.random.normal(jax.random.PRNGKey(1), (6, 50)) * 3
  tokens = jnp.arange(6) * 7
  keep = support(logits, temperature, 10, 0.9)
  keep = keep.at[jnp.arange(6), tokens].set(True)
  full, trunc = sampling.token_logprobs(logits, tokens, temperature, keep)
  z = np.asarray(logits, np.float64) / temperature
  ref = z - np.log(np.exp(z).sum(-1, keepdims=True))
  ref_full = ref[np.arange(6), np.asarray(tokens)]
  np.testing.assert_allclose(full, ref_full, atol=1e-5)
  log_z = np.log(np.where(keep, np.exp(ref), 0).sum(-1))
  np.testing.assert_allclose(trunc, ref_full - log_z, atol=1e-5)
  assert bool((trunc >= full - 1e-6).all())
  # The τ = 1 value is a different number (mutation of
  # docs/math/rollout_contract.md §8 test 2).
  if temperature != 1.0:
    assert not np.allclose(
      sampling.token_logprobs(logits, tokens, 1.0)[0], full
    )


def test_greedy_is_top_k_one_whatever_the_key():
  logits = jax.random.normal(jax.random.PRNGKey(2), (8, 40))
  for seed in range(3):
    tok, full, trunc = sample(_keys(8, seed), logits, 0.8, 1)
    np.testing.assert_array_equal(tok, jnp.argmax(logits, -1))
    np.testing.assert_allclose(trunc, 0.0, atol=1e-6)
    assert bool((full < 0).all())


def test_a_rows_draw_does_not_depend_on_its_neighbours():
  logits = jax.random.normal(jax.random.PRNGKey(3), (4, 30))
  keys = _keys(4)
  tok, _, _ = sample(keys, logits, 1.0)
  other = logits.at[1:].set(jax.random.normal(jax.random.PRNGKey(4), (3, 30)))
  tok2, _, _ = sample(keys, other, 1.0, jnp.asarray([0, 1, 2, 3]))
  assert int(tok[0]) == int(tok2[0])


@pytest.mark.parametrize(
  'top_k, top_p, temperature', [(0, 1.0, 0.7), (5, 1.0, 1.3), (0, 0.8, 1.0)]
)
def test_empirical_frequencies_match_the_reported_logprobs(
  top_k, top_p, temperature
):
  """docs/math/rollout_contract.md §8 test 3: 10^5 draws at one context,
  chi-square p > 0.001."""
  n, v = 100_000, 12
  logits = jax.random.normal(jax.random.PRNGKey(5), (v,)) * 1.5
  tok, _, trunc = sample(
    _keys(n, 7), jnp.broadcast_to(logits, (n, v)), temperature, top_k, top_p
  )
  counts = np.bincount(np.asarray(tok), minlength=v)
  # The distribution the rule defines, in float64: softmax(z / τ) on the
  # kept set, renormalised. Every id is scored, drawn or not (a rare id
  # may go undrawn in 10^5 draws).
  keep = np.asarray(support(logits[None], temperature, top_k, top_p))[0]
  q = np.exp(np.asarray(logits, np.float64) / temperature)
  ref = np.where(keep, q, 0.0) / np.where(keep, q, 0.0).sum()
  kept = ref > 0
  assert counts[~kept].sum() == 0
  # The reported log-prob of each draw is that distribution's.
  np.testing.assert_allclose(
    np.exp(np.asarray(trunc, np.float64)), ref[np.asarray(tok)], rtol=1e-4
  )
  _, p = stats.chisquare(counts[kept], ref[kept] * n)
  assert p > 1e-3
  if top_k or top_p < 1:
    assert kept.sum() < v


def test_blocked_draw_is_exact_across_blocks_and_padding():
  """`sampling.draw` races over block sums, then inside the chosen block:
  V = 37 makes 5 blocks of 8 (3 padding entries); zero weights are never
  drawn and the frequencies follow w / Σ w (chi-square p > 0.001)."""
  n, v = 100_000, 37
  w = np.asarray(jax.random.uniform(jax.random.PRNGKey(8), (v,)), np.float64)
  w = w**3
  w[[0, 7, 8, 20, 36]] = 0.0  # block edges and the last real entry
  tok = jax.jit(sampling.draw)(_keys(n, 9), jnp.broadcast_to(w, (n, v)))
  counts = np.bincount(np.asarray(tok), minlength=v)
  assert counts.size == v  # nothing past the vocabulary
  assert counts[w == 0].sum() == 0
  kept = w > 0
  expected = w[kept] / w[kept].sum() * counts.sum()
  _, p = stats.chisquare(counts[kept], expected)
  assert p > 1e-3


def test_untruncated_path_equals_the_general_path():
  """Without truncation `sample` skips the log-softmax and `support`
  (`_sample_untruncated`); the general path with every filter off draws
  the same tokens with the same log-probs (the race is scale-invariant:
  exp(z - max) vs its normalised q)."""
  logits = jax.random.normal(jax.random.PRNGKey(11), (64, 4096)) * 3
  logits = logits.at[:, 4000:].set(-jnp.inf)  # padded vocabulary columns
  z = sampling.scaled_logits(logits, 0.7)
  keys = _keys(64, 12)
  fast = jax.jit(sampling._sample_untruncated)(keys, z)
  slow = jax.jit(sampling._sample_truncated)(keys, z, 0, 1.0, 0.0)
  np.testing.assert_array_equal(fast[0], slow[0])
  assert int(fast[0].max()) < 4000
  for a, b in zip(fast[1:], slow[1:]):
    np.testing.assert_allclose(a, b, atol=1e-5)
  full, _ = sampling.token_logprobs(logits, fast[0], 0.7)
  np.testing.assert_allclose(fast[1], full, atol=1e-5)
  np.testing.assert_array_equal(sample(keys, logits, 0.7)[0], fast[0])
