"""A safe arithmetic evaluator (no `eval`) and the calculator `Tool`.

The expression is parsed with `ast` and only numbers, + - * / // %, unary
signs, parentheses and bounded powers are evaluated; anything else (names,
calls, attributes, strings) is refused. Integers stay exact (Python ints),
so multi-digit products are right to the last digit; results and operands
are bounded so an agent cannot make the tool spend minutes on 9**9**9.
"""

from __future__ import annotations

import ast
import operator

from jaxcorr.agents.tools import Tool

MAX_DIGITS = 64  # the largest |value| has at most this many digits
MAX_EXPONENT = 64
MAX_LENGTH = 256  # characters of an expression

_BINARY = {
  ast.Add: operator.add,
  ast.Sub: operator.sub,
  ast.Mult: operator.mul,
  ast.Div: operator.truediv,
  ast.FloorDiv: operator.floordiv,
  ast.Mod: operator.mod,
  ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
  """An expression the calculator refuses or cannot evaluate."""


def _bounded(value: int | float) -> int | float:
  if isinstance(value, int) and len(str(abs(value))) > MAX_DIGITS:
    raise CalculatorError(f'result has more than {MAX_DIGITS} digits')
  if isinstance(value, float) and not abs(value) < 10.0**MAX_DIGITS:
    raise CalculatorError('result out of range')
  return value


def _eval(node: ast.AST) -> int | float:
  if isinstance(node, ast.Expression):
    return _eval(node.body)
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    return _bounded(node.value)
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _UNARY[type(node.op)](_eval(node.operand))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _eval(node.left), _eval(node.right)
    if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
      raise CalculatorError(f'exponent above {MAX_EXPONENT}')
    try:
      return _bounded(_BINARY[type(node.op)](left, right))
    except ZeroDivisionError as err:
      raise CalculatorError('division by zero') from err
  raise CalculatorError(f'unsupported syntax: {type(node).__name__}')


def evaluate(expression: str) -> int | float:
  """The value of an arithmetic expression; `CalculatorError` otherwise."""
  if len(expression) > MAX_LENGTH:
    raise CalculatorError(f'expression longer than {MAX_LENGTH} characters')
  try:
    tree = ast.parse(expression.strip(), mode='eval')
  except SyntaxError as err:
    raise CalculatorError(f'not an expression: {expression!r}') from err
  return _eval(tree)


def format_value(value: int | float) -> str:
  """Integers exactly; floats rounded to 10 significant digits, without a
  trailing '.0' when integral."""
  if isinstance(value, float):
    if value.is_integer():
      return str(int(value))
    return f'{value:.10g}'
  return str(value)


def calculate(expression: str) -> str:
  """The tool function: the expression's value as text."""
  return format_value(evaluate(expression))


def calculator_tool() -> Tool:
  """The calculator as an OpenAI-style tool."""
  return Tool(
    name='calculator',
    description=(
      'Evaluate an arithmetic expression with + - * / // % ** and '
      'parentheses; returns the exact value.'
    ),
    parameters={
      'type': 'object',
      'properties': {
        'expression': {
          'type': 'string',
          'description': 'e.g. "123 * 456"',
        }
      },
      'required': ['expression'],
      'additionalProperties': False,
    },
    fn=calculate,
  )
