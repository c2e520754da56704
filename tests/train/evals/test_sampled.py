"""pass@k / maj@k / sampled accuracy of a set's samples on controlled
cases, against the closed form 1 - C(n-c, k)/C(n, k)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxcorr.train.evals.sampled import answer_of, sampled_metrics


def test_pass_at_k_averages_the_closed_form_over_prompts():
  n = 6
  correct = [0, 1, 3, 6]  # correct samples of each of 4 prompts
  scores, replies = [], []
  for c in correct:
    row = [1.0] * c + [0.0] * (n - c)
    scores += row
    replies += ['7' if s else '3' for s in row]
  got = sampled_metrics(
    np.array(scores), replies, samples=n, ks=(1, 2, 6), answer=answer_of('x')
  )
  for k in (1, 2, 6):
    want = np.mean([1 - math.comb(n - c, k) / math.comb(n, k) for c in correct])
    assert got[f'pass@{k}'] == pytest.approx(want, rel=1e-12)
  assert got['sampled_accuracy'] == pytest.approx(sum(correct) / (4 * n))
  # maj@1 votes the first sample; maj@6 the most frequent answer: '3'
  # for c=1, '7' for c=6 and for the 3-3 tie of c=3 (seen first).
  assert got['maj@1'] == pytest.approx(0.75)
  assert got['maj@6'] == pytest.approx(0.5)


def test_partial_credit_is_not_correct_but_counts_in_accuracy():
  got = sampled_metrics(
    np.array([0.5, 1.0]),
    ['a', 'b'],
    samples=2,
    ks=(1,),
    answer=answer_of('exact_match'),
  )
  assert got['pass@1'] == 0.5
  assert got['sampled_accuracy'] == 0.75


def test_answers_are_read_as_the_first_reward_reads_them():
  assert answer_of('exact_match')(' 42 ') == '42'
  assert answer_of('exact_match')('  ') is None
  assert answer_of('math_answer')('so it is \\boxed{3/4}.') == '3/4'
  assert answer_of('math_verify')('#### 1,234') == '1,234'
