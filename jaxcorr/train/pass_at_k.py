"""pass@k and maj@k of sampled evaluation, as pure functions of one
prompt's samples (the caller averages over prompts).

pass@k: the probability that at least one of k samples drawn without
replacement from the prompt's n samples is correct, c of them being
correct. The unbiased estimator (Chen et al. 2021, "Evaluating Large
Language Models Trained on Code"):

    pass@k = 1 - C(n - c, k) / C(n, k)
           = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

The product form never forms a binomial coefficient (C(200, 100) is
~9e58), so it is exact to float64 rounding for any n. It is 1 when
n - c < k (every k-subset holds a correct sample) and 0 when c = 0.

maj@k: majority vote over the first k samples' extracted answers (samples
are i.i.d., so the first k are a uniform k-subset and the mean over
prompts is unbiased); a tie goes to the answer seen first, a sample
without an answer does not vote, and a prompt whose k samples hold no
answer scores 0. The vote is correct when the winning answer's first
sample is correct.
"""

from __future__ import annotations

from collections.abc import Sequence


def _check(n: int, c: int, k: int) -> None:
  if not 0 <= c <= n:
    raise ValueError(f'need 0 <= c <= n, got c={c}, n={n}')
  if not 1 <= k <= n:
    raise ValueError(f'need 1 <= k <= n, got k={k}, n={n}')


def pass_at_k(n: int, c: int, k: int) -> float:
  """The unbiased pass@k of one prompt: n samples, c correct (module doc).

  Raises:
    ValueError: unless 0 <= c <= n and 1 <= k <= n.
  """
  _check(n, c, k)
  if n - c < k:
    return 1.0
  prod = 1.0
  for i in range(n - c + 1, n + 1):
    prod *= 1.0 - k / i
  return 1.0 - prod


def maj_at_k(
  answers: Sequence[str | None], correct: Sequence[bool], k: int
) -> float:
  """maj@k of one prompt: 1.0 when the majority answer of the first k
  samples is correct, else 0.0 (module doc).

  Args:
    answers: each sample's extracted answer (None or '': no answer).
    correct: whether each sample is correct.
    k: the samples that vote, 1 <= k <= len(answers).
  """
  if len(answers) != len(correct):
    raise ValueError(
      f'answers and correct differ in length: {len(answers)} vs {len(correct)}'
    )
  _check(len(answers), 0, k)
  votes: dict[str, int] = {}
  first: dict[str, bool] = {}
  for answer, ok in zip(answers[:k], correct[:k], strict=True):
    if not answer:
      continue
    votes[answer] = votes.get(answer, 0) + 1
    first.setdefault(answer, bool(ok))
  if not votes:
    return 0.0
  top = max(votes.values())
  winner = next(a for a in votes if votes[a] == top)  # first seen wins ties
  return 1.0 if first[winner] else 0.0
