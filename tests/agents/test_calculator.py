"""The calculator evaluates arithmetic exactly and refuses everything else
(no `eval`: names, calls, attributes, huge powers)."""

import pytest

from jaxcorr.agents.calculator import (
  CalculatorError,
  calculate,
  calculator_tool,
)


def test_exact_multi_digit_arithmetic():
  assert calculate('123456789 * 987654321') == str(123456789 * 987654321)
  assert calculate('(17 + 25) * -3') == '-126'
  assert calculate('7 / 2') == '3.5'
  assert calculate('8 / 2') == '4'
  assert calculate('2 ** 10 % 1000') == '24'


@pytest.mark.parametrize(
  'expression',
  [
    "__import__('os').system('true')",
    'open("x")',
    'x + 1',
    '(1).real',
    '"a" * 3',
    '9 ** 9 ** 9',
    '10 ** 100',
    '1 / 0',
    '1 +',
    '[1, 2]',
  ],
)
def test_refuses(expression):
  with pytest.raises(CalculatorError):
    calculate(expression)


def test_tool_schema_is_openai_style():
  schema = calculator_tool().schema()
  assert schema['type'] == 'function'
  fn = schema['function']
  assert fn['name'] == 'calculator'
  assert fn['parameters']['required'] == ['expression']
