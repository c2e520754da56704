"""The metrics of a set's sampled pass: n replies per prompt, scored by the
run's reward functions.

A sample is *correct* when the first reward function gives it 1 (>= 1 -
1e-6): exact_match, math_answer, math_verify and reasoning-gym's scorers
give 1 to a right answer (reasoning-gym may give partial credit to a wrong
one). Per set, averaged over prompts:

* `pass@k`: the unbiased estimator of `jaxcorr.train.pass_at_k` from each
  prompt's n samples, c of them correct;
* `maj@k`: the majority vote of each prompt's first k samples
  (`jaxcorr.train.pass_at_k.maj_at_k`), on the answers the first reward
  function reads (`answer_of`);
* `sampled_accuracy`: the mean of the first reward function over every
  sample (greedy `accuracy`'s definition, on sampled replies).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from jaxcorr.rewards import extract_answer
from jaxcorr.train.pass_at_k import maj_at_k, pass_at_k

CORRECT = 1.0 - 1e-6


def answer_of(reward_name: str) -> Callable[[str], str | None]:
  """The answer a reply votes for in maj@k, read as `reward_name` reads it:
  exact_match compares the stripped reply, reasoning-gym the last
  `<answer>` tag, the math rewards the final answer (`extract_answer`)."""
  if reward_name in ('exact_match', 'arith_exact'):
    return lambda reply: reply.strip() or None
  if reward_name == 'reasoning_gym':
    from jaxcorr.data import reasoning_gym

    return reasoning_gym.extract
  return extract_answer


def sampled_metrics(
  scores: np.ndarray,
  replies: Sequence[str],
  *,
  samples: int,
  ks: Sequence[int],
  answer: Callable[[str], str | None],
) -> dict[str, float]:
  """pass@k, maj@k and sampled accuracy of one set (module doc).

  Args:
    scores: `[P * n]` the first reward function's value of each sample,
      a prompt's n samples adjacent.
    replies: the `P * n` decoded replies, in the same order.
    samples: n, the samples per prompt.
    ks: the k's reported, each <= n.
    answer: reply -> the answer it votes for (`answer_of`).
  """
  scores = np.asarray(scores, np.float64).reshape(-1, samples)
  correct = scores >= CORRECT
  answers = [answer(r) for r in replies]
  out = {'sampled_accuracy': float(scores.mean()) if scores.size else 0.0}
  for k in ks:
    passes, votes = [], []
    for p, row in enumerate(correct):
      passes.append(pass_at_k(samples, int(row.sum()), k))
      votes.append(maj_at_k(answers[p * samples : (p + 1) * samples], row, k))
    out[f'pass@{k}'] = float(np.mean(passes)) if passes else 0.0
    out[f'maj@{k}'] = float(np.mean(votes)) if votes else 0.0
  return out
