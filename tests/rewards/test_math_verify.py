"""The `math_verify` reward: HF math-verify's parse/verify behind the
registry, its own signal timeouts off, the scorer's timeouts in force."""

from __future__ import annotations

import threading

import pytest

from jaxcorr import rewards as R
from jaxcorr.rewards import verifiers

mv = R.REWARDS['math_verify']

EQUIVALENT = [
  # (response, reference)
  (r'The answer is $\frac{1}{2}$.', '0.5'),
  ('So x = 0.5, i.e. \\boxed{0.5}', r'\frac{1}{2}'),
  (r'\boxed{2}', '2'),
  ('Total: 1,000 apples, so \\boxed{1,000}', '1000'),
  (r'\boxed{1000}', '1,000'),
  (r'The roots are $\boxed{\{2, 1\}}$', r'\{1,2\}'),
  (r'so $x \in \boxed{(1, 2]}$', '(1,2]'),
  (r'\boxed{\frac{1}{\sqrt{2}}}', r'\frac{\sqrt{2}}{2}'),
  ('Natalia sold 48 + 24 = 72 clips.\n#### 72', '72'),
  ('72', 'She earns 9 * 8 = 72 dollars.\n#### 72'),
]

DIFFERENT = [
  (r'\boxed{3}', '2'),
  (r'\boxed{0.25}', '0.5'),
  (r'$x \in \boxed{[1, 2]}$', '(1,2]'),
  (r'\boxed{\{1, 3\}}', r'\{1,2\}'),
  ('I cannot solve this.', '7'),
  (r'\boxed{2}', ''),
]


@pytest.mark.parametrize('response,reference', EQUIVALENT)
def test_equivalent_answers_score_one(response, reference):
  assert mv(response, reference) == 1.0


@pytest.mark.parametrize('response,reference', DIFFERENT)
def test_different_answers_score_zero(response, reference):
  assert mv(response, reference) == 0.0


def test_runs_off_the_main_thread():
  """math-verify's own signal.alarm timeout raises off the main thread; the
  reward disables it, so a worker thread gets the verdict."""
  out = []
  t = threading.Thread(target=lambda: out.append(mv(r'\boxed{2}', '2')))
  t.start()
  t.join(60)
  assert out == [1.0]


def test_through_the_scorer():
  scorer = R.RewardScorer(
    R.parse_spec('math_verify'), timeout_s=30, step_budget_s=60
  )
  try:
    rewards, metrics = scorer.score(
      [r'\boxed{\frac{1}{2}}', r'\boxed{3}'], ['0.5', '2']
    )
  finally:
    scorer.close()
  assert rewards.tolist() == [1.0, 0.0]
  assert metrics['reward/failures'] == 0
  assert metrics['reward/timeouts'] == 0


def test_check_installed_names_the_extra(monkeypatch):
  R.check_installed(['math_verify', 'reasoning_gym', 'exact_match'])
  # The reward's package under a name that is not installed.
  monkeypatch.setitem(
    verifiers.EXTRAS, 'math_verify', ('jaxcorr_no_such_package', 'math')
  )
  with pytest.raises(ValueError, match=r'pip install jaxcorr\[math\]'):
    R.check_installed(['math_verify'])


# Realistic replies (GSM8K- and MATH-style) with (math_answer, math_verify)
# as scored; docs/data_and_rewards.md tabulates them and says why the two
# disagree, so this test keeps that table true.
COMPARISON = [
  (
    'Natalia sold 48/2 = 24 clips in May. Altogether she sold 48 + 24 = 72 '
    'clips.\n#### 72',
    '72',
    1,
    1,
  ),
  (
    'Weng earns 12/60 = $0.2 per minute. For 50 minutes she earned 0.2 x 50 '
    '= $10.\n#### 10',
    '10',
    1,
    1,
  ),
  (
    'She needs 100 - 50 - 30 - 15 = 5 more dollars. The answer is 5.',
    '5',
    1,
    1,
  ),
  (
    'Each box holds 1,250 marbles, so 4 boxes hold 5,000 marbles.\n#### 5,000',
    '5000',
    1,
    1,
  ),
  ('The price after the discount is $18.00, so the answer is $18.', '18', 1, 1),
  ('The total is 3 + 4 = 7 hours, which is 420 minutes.', '7', 0, 0),
  (
    'So the probability is $\\frac{3}{4}$.\nThe answer is '
    '\\boxed{\\dfrac{3}{4}}',
    '0.75',
    1,
    1,
  ),
  (
    'Simplifying, we get $\\boxed{\\frac{\\sqrt{3}}{2}}$.',
    '\\frac{\\sqrt{3}}{2}',
    1,
    1,
  ),
  (
    'Rationalizing: $\\frac{1}{\\sqrt{2}} = \\boxed{\\frac{\\sqrt2}{2}}$',
    '\\frac{1}{\\sqrt{2}}',
    0,
    1,
  ),
  (
    'The solutions are $x = 2$ and $x = -3$, so $\\boxed{-3, 2}$.',
    '2, -3',
    0,
    1,
  ),
  ('Thus the set is $\\boxed{\\{1, 2, 3\\}}$.', '\\{3,2,1\\}', 0, 1),
  (
    'The inequality holds for $x \\in \\boxed{(-\\infty, 2]}$.',
    '(-\\infty,2]',
    1,
    1,
  ),
  (
    'The inequality holds for $x \\in \\boxed{(-\\infty, 2)}$.',
    '(-\\infty,2]',
    0,
    0,
  ),
  ('Expanding, $(x+1)^2 = \\boxed{x^2 + 2x + 1}$.', 'x^2+2x+1', 1, 1),
  ('So $f(x) = \\boxed{2x + 2}$.', '2(x+1)', 0, 1),
  ('So the total is 2x+2.', '2(x+1)', 0, 0),
  ('The angle is $\\boxed{30^\\circ}$.', '30', 0, 1),
  ('That is 25% of the class, \\boxed{25\\%}.', '25', 0, 1),
  (
    'So the answer is $\\boxed{\\pi}$ square units, about 3.14159.',
    '\\pi',
    1,
    1,
  ),
  (
    'I think the answer is 12. Wait, recomputing: 3 * 5 = 15. So 15.',
    '15',
    1,
    1,
  ),
  ('The answer is 8. It took 3 steps.', '8', 0, 1),
  ('#### 72\nThat is 3 more than last week.', '72', 1, 0),
  ('We have $a = 4$ and $b = 9$, so $a + b = 13$.', '13', 1, 1),
  (
    'The matrix is $\\boxed{\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 '
    '\\end{pmatrix}}$.',
    '\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}',
    1,
    1,
  ),
  ('The answer is $\\boxed{\\text{(B)}}$.', 'B', 0, 1),
  ('\\boxed{1{,}000}', '1000', 0, 1),
  ('The side is \\boxed{5\\text{ cm}}', '5', 0, 1),
]


@pytest.mark.parametrize('reply,reference,answer,verify', COMPARISON)
def test_comparison_with_math_answer(reply, reference, answer, verify):
  got = (R.REWARDS['math_answer'](reply, reference), mv(reply, reference))
  assert got == (answer, verify)


def test_comparison_counts():
  """The counts docs/data_and_rewards.md quotes."""
  a = sum(r[2] for r in COMPARISON)
  v = sum(r[3] for r in COMPARISON)
  only_v = sum(r[3] and not r[2] for r in COMPARISON)
  only_a = sum(r[2] and not r[3] for r in COMPARISON)
  assert (len(COMPARISON), a, v, only_v, only_a) == (27, 14, 23, 10, 1)
