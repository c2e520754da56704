"""`code_tests`: the reward of model-written Python against hidden tests,
run in the sandbox (`jaxcorr.sandbox`).

A row's reference answer is JSON, `{"tests": ["f(2) == 4", ...]}`: Python
expressions over the names the solution defines. The reply's code is its
last fenced block (```python ... ``` or ``` ... ```), else the whole reply
when it contains a `def`. In one sandbox run, `harness.py` executes the
code, then evaluates each test (an exception or a falsy value fails it),
and prints `<nonce> <passed> <total>`. The nonce is drawn per run and read
by the harness from a file it deletes before the solution runs, so a reply
that prints a fake result line does not score.

The value is passed / total. The reason (`Outcome.reason`, counted by the
scorer in `reward/code_tests/outcome/<reason>`) is 'passed' (all tests),
'failed_tests', 'no_code', 'error' (the code raised before the tests, or
the harness could not report), or the runner's 'timeout', 'memory',
'output_limit', 'killed'; all but 'failed_tests' score 0. A sandbox that
cannot be built is the host's fault, not the reply's: the call raises and
counts in `reward/failures` (the scorer stops a run where it always does).

Time: the run's wall clock is `Limits.timeout_s` (3 s here) plus about
0.1 s of start-up; keep `config.reward.timeout_s` above it, or the scorer
abandons the call first (`isolation='thread'`: the sandbox is still killed
at its own deadline; `'process'`: the worker and, with it, the sandbox).
`make_code_reward` builds the same reward with other limits, for a config file
to register under its own name.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable

from jaxcorr.rewards.registry import Outcome, register
from jaxcorr.sandbox import runner

FENCE = re.compile(r'```[ \t]*(?:python|py)?[ \t]*\n(.*?)```', re.S)

# Runs inside the sandbox (python -I -S), standard library only.
HARNESS = """\
import json, os, sys
with open('tests.json') as f:
  spec = json.load(f)
os.remove('tests.json')
nonce, tests = spec['nonce'], spec['tests']
del spec
out = sys.stdout
with open('solution.py') as f:
  source = f.read()
space = {'__name__': 'solution'}
exec(compile(source, 'solution.py', 'exec'), space)
passed = 0
for test in tests:
  try:
    passed += bool(eval(test, space))
  except BaseException:
    pass
out.write(f'\\n{nonce} {passed} {len(tests)}\\n')
out.flush()
os._exit(0)
"""

CODE_LIMITS = runner.Limits(timeout_s=3.0, cpu_s=3)


def extract_code(response: str) -> str | None:
  """The reply's last fenced code block, else the reply when it has a
  `def`, else None."""
  blocks = FENCE.findall(response)
  if blocks:
    return blocks[-1]
  return response if 'def ' in response else None


def parse_tests(answer: str) -> list[str]:
  """The test expressions of a reference answer; ValueError naming the
  expected form (a data bug: the scorer counts it as a failure)."""
  try:
    tests = json.loads(answer)['tests']
  except (ValueError, TypeError, KeyError):
    tests = None
  if not tests or not all(isinstance(t, str) for t in tests):
    raise ValueError(
      f'code_tests: reference answer {answer[:80]!r}; allowed: JSON '
      '{"tests": ["<python expression>", ...]} with at least one test'
    )
  return tests


def run_tests(
  code: str, tests: list[str], limits: runner.Limits = CODE_LIMITS
) -> tuple[Outcome, runner.Result]:
  """(the outcome, the sandbox run) of `code` against `tests`."""
  nonce = secrets.token_hex(8)
  files = {
    'solution.py': code,
    'tests.json': json.dumps({'nonce': nonce, 'tests': tests}),
    'harness.py': HARNESS,
  }
  result = runner.run_python(files, 'harness.py', limits)
  if result.status == runner.SETUP:
    raise RuntimeError(f'the code sandbox failed to start: {result.detail}')
  if result.status != runner.OK:
    return Outcome(0.0, result.status), result
  found = re.findall(rf'^{nonce} (\d+) (\d+)$', result.stdout, re.M)
  if not found:
    return Outcome(0.0, runner.ERROR), result
  passed, total = (int(x) for x in found[-1])
  if passed == total:
    return Outcome(1.0, 'passed'), result
  return Outcome(passed / total, 'failed_tests'), result


def make_code_reward(
  limits: runner.Limits = CODE_LIMITS,
) -> Callable[[str, str], Outcome]:
  """The `code_tests` reward with other limits (module doc)."""

  def code_tests(response: str, answer: str) -> Outcome:
    tests = parse_tests(answer)
    code = extract_code(response)
    if code is None:
      return Outcome(0.0, 'no_code')
    return run_tests(code, tests, limits)[0]

  return code_tests


code_tests = register('code_tests')(make_code_reward())
