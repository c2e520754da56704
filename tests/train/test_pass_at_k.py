"""pass@k against the closed form 1 - C(n-c, k)/C(n, k) (exact rationals)
and its edge cases; maj@k on votes, ties and missing answers."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from jaxcorr.train.pass_at_k import maj_at_k, pass_at_k


def _closed_form(n: int, c: int, k: int) -> Fraction:
  return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


@pytest.mark.parametrize('n', [1, 2, 5, 8, 16])
def test_pass_at_k_matches_the_closed_form(n):
  for c in range(n + 1):
    for k in range(1, n + 1):
      want = float(_closed_form(n, c, k))
      assert pass_at_k(n, c, k) == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_pass_at_k_large_n_is_stable():
  # C(200, 100) ~ 9e58: the ratio form overflows float64 intermediates
  # in naive code; the product form stays exact to rounding.
  for c, k in [(1, 100), (3, 50), (50, 100), (199, 1)]:
    want = float(_closed_form(200, c, k))
    assert pass_at_k(200, c, k) == pytest.approx(want, rel=1e-12)


def test_pass_at_k_edge_cases():
  assert pass_at_k(8, 0, 1) == 0.0  # c = 0
  assert pass_at_k(8, 0, 8) == 0.0
  assert pass_at_k(8, 8, 1) == 1.0  # c = n
  assert pass_at_k(8, 1, 8) == 1.0  # k = n: every sample is drawn
  assert pass_at_k(8, 3, 8) == 1.0
  assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # pass@1 = c / n
  assert pass_at_k(10, 4, 7) == 1.0  # n - c < k
  for bad in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
    with pytest.raises(ValueError, match='need'):
      pass_at_k(*bad)


def test_pass_at_k_grows_with_k():
  values = [pass_at_k(16, 3, k) for k in range(1, 17)]
  assert values == sorted(values) and values[-1] == 1.0


def test_maj_at_k_votes():
  answers = ['3', '4', '4', '3', '4', None]
  correct = [True, False, False, True, False, False]
  assert maj_at_k(answers, correct, 1) == 1.0  # '3' alone
  assert maj_at_k(answers, correct, 3) == 0.0  # '4' twice
  assert maj_at_k(answers, correct, 4) == 1.0  # 2-2 tie: '3' seen first
  assert maj_at_k(answers, correct, 6) == 0.0  # '4' three times, None no vote


def test_maj_at_k_without_answers_and_errors():
  assert maj_at_k([None, ''], [False, False], 2) == 0.0
  assert maj_at_k(['1', '1'], [True, True], 2) == 1.0  # all correct
  with pytest.raises(ValueError, match='differ in length'):
    maj_at_k(['1'], [True, False], 1)
  with pytest.raises(ValueError, match='need 1 <= k <= n'):
    maj_at_k(['1'], [True], 2)
