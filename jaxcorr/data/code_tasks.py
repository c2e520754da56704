"""A generated code task (`config.data.source='code'`): 'write a function
f(x) that returns ...' with hidden tests, scored by `code_tests`
(jaxcorr/rewards/code.py) in the sandbox.

Example i of seed s is a pure function of (s, i), like the arithmetic
task's (`np.random.default_rng([s, i])`): a kind of function, a constant
`a` in [2, 9], and five test inputs in [-20, 20]. The prompt asks for the
code in a ```python block; the answer is the JSON the reward reads,
`{"tests": ["f(3) == 7", ...]}` (the expected values computed here, so
they are never shown to the model). Small enough for SmolLM2-135M to get
some right and some wrong, which is what GRPO needs.
"""

from __future__ import annotations

import collections.abc
import json

import numpy as np

from jaxcorr.data.tasks import Example

# (what f returns, in words; the reference f). `a` is the drawn constant.
KINDS = (
  ('x plus {a}', lambda x, a: x + a),
  ('x times {a}', lambda x, a: x * a),
  ('x minus {a}', lambda x, a: x - a),
  ('the square of x', lambda x, a: x * x),
  ('the larger of x and {a}', max),
  ('the remainder of x divided by {a}', lambda x, a: x % a),
  ('the absolute value of x', lambda x, a: abs(x)),
  ('x integer-divided by {a}', lambda x, a: x // a),
)
TESTS = 5
PROMPT = (
  'Write a Python function f(x) that takes an integer x and returns {what}. '
  'Reply with only the code in a ```python block.'
)


def code_example(seed: int, index: int) -> Example:
  """Example `index` of the task with this seed (module doc)."""
  rng = np.random.default_rng([seed, index])
  what, fn = KINDS[int(rng.integers(len(KINDS)))]
  a = int(rng.integers(2, 10))
  xs = [int(x) for x in rng.integers(-20, 21, size=TESTS)]
  tests = [f'f({x}) == {fn(x, a)}' for x in xs]
  return Example(
    prompt=PROMPT.format(what=what.format(a=a)),
    answer=json.dumps({'tests': tests}),
  )


class CodeSource(collections.abc.Sequence):
  """`num_examples` generated examples, computed on access."""

  def __init__(self, num_examples: int, seed: int):
    self.num_examples, self.seed = num_examples, seed

  def __len__(self) -> int:
    return self.num_examples

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self[j] for j in range(*i.indices(self.num_examples))]
    n = self.num_examples
    if not -n <= i < n:
      raise IndexError(f'index {i} out of range for {n} examples')
    return code_example(self.seed, i % n)

  def __repr__(self) -> str:
    return f'CodeSource(num_examples={self.num_examples}, seed={self.seed})'
