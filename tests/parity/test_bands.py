"""`jaxcorr.parity.bands` against a plain numpy reference, loop by loop."""

import math

import numpy as np
import pytest

from jaxcorr.parity.bands import BANDS, parity_bands


def _reference(pi, mu, mask, argmax_pi, argmax_mu, argmax_mask):
  """The statistics one token and one row at a time."""
  tokens, seqs, bits, k3s, gaps = [], [], [], [], []
  for b in range(pi.shape[0]):
    row = []
    for t in range(pi.shape[1]):
      if not mask[b, t]:
        continue
      d = float(pi[b, t]) - float(mu[b, t])
      row.append(d)
      tokens.append(abs(math.exp(d) - 1))
      r = min(max(d, -20.0), 20.0)
      k3s.append(math.exp(r) - 1 - r)
      gaps.append(abs(d))
      bits.append(pi[b, t].tobytes() == mu[b, t].tobytes())
    if row:
      seqs.append(abs(math.exp(sum(row) / len(row)) - 1))
  out = {'tokens': len(tokens), 'sequences': len(seqs)}
  for label, tol in BANDS:
    out[f'token_{label}'] = np.mean([x <= tol for x in tokens])
    out[f'seq_{label}'] = np.mean([x <= tol for x in seqs])
  out['max_abs_dlogp'] = max(gaps)
  out['k3'] = np.mean(k3s)
  out['bitwise'] = np.mean(bits)
  agree = [
    argmax_pi[i, j] == argmax_mu[i, j]
    for i in range(argmax_pi.shape[0])
    for j in range(argmax_pi.shape[1])
    if argmax_mask[i, j]
  ]
  out['argmax'] = np.mean(agree)
  return out


def test_bands_match_the_numpy_reference():
  rng = np.random.default_rng(0)
  b, t = 6, 9
  mu = rng.uniform(-6, 0, (b, t)).astype(np.float32)
  # Gaps spanning every band, some tokens bit-equal, one -0.0 vs 0.0.
  scale = rng.choice([0.0, 5e-4, 5e-3, 3e-2, 0.3], (b, t))
  pi = (mu + scale * rng.choice([-1, 1], (b, t))).astype(np.float32)
  mu[0, 0], pi[0, 0] = 0.0, -0.0
  mask = rng.uniform(size=(b, t)) < 0.8
  mask[-1] = False  # a row with no response token counts in no band
  # ±0.3 in turn: the geometric mean ratio is 1, the arithmetic one 1.045.
  pi[1] = mu[1] + np.float32(0.3) * np.array([1, -1] * 4 + [0])
  mask[1] = [True] * 8 + [False]
  ids_mu = rng.integers(0, 5, (3, 4))
  ids_pi = np.where(rng.uniform(size=(3, 4)) < 0.7, ids_mu, ids_mu + 1)
  amask = rng.uniform(size=(3, 4)) < 0.9
  got = parity_bands(
    pi, mu, mask, argmax_pi=ids_pi, argmax_mu=ids_mu, argmax_mask=amask
  )
  want = _reference(pi, mu, mask, ids_pi, ids_mu, amask)
  assert set(got) == set(want)
  for key, value in want.items():
    assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key
  # The bands are not all 0 or 1: the data exercises them.
  assert 0 < got['token_0.1%'] < got['token_1%'] < got['token_5%'] < 1
  assert 0 < got['bitwise'] < 1 and 0 < got['argmax'] < 1


def test_equal_inputs_are_perfect_and_empty_mask_is_nan():
  x = np.full((2, 3), -1.5, np.float32)
  mask = np.ones((2, 3), bool)
  out = parity_bands(x, x.copy(), mask)
  assert out['bitwise'] == 1 and out['max_abs_dlogp'] == 0 and out['k3'] == 0
  assert all(out[f'token_{b}'] == 1 == out[f'seq_{b}'] for b, _ in BANDS)
  assert 'argmax' not in out
  empty = parity_bands(x, x, np.zeros((2, 3), bool))
  assert math.isnan(empty['token_1%']) and math.isnan(empty['seq_1%'])
  assert math.isnan(empty['max_abs_dlogp']) and empty['tokens'] == 0
