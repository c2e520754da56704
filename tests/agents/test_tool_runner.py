"""Every tool call is contained: a tool that raises, hangs, or returns
garbage, an unknown tool and arguments that miss the schema each end in an
error message for the agent and a count, never an exception."""

import threading

import pytest

from jaxcorr.agents.tool_calls import ToolCall
from jaxcorr.agents.tool_runner import ToolRunner
from jaxcorr.agents.tools import Tool

_ANY = {'type': 'object', 'properties': {}, 'additionalProperties': False}
_RELEASE = threading.Event()


def _tools():
  def raises():
    raise RuntimeError('boom')

  def hangs():
    _RELEASE.wait(30)
    return 'late'

  return [
    Tool('ok', 'returns text', _ANY, lambda: 'fine'),
    Tool('number', 'returns a number', _ANY, lambda: 42),
    Tool('raises', 'raises', _ANY, raises),
    Tool('hangs', 'never returns in time', _ANY, hangs),
    Tool('garbage', 'returns None', _ANY, lambda: None),
    Tool('huge', 'returns too much', _ANY, lambda: 'x' * 10_000),
    Tool(
      'typed',
      'wants an int',
      {
        'type': 'object',
        'properties': {'n': {'type': 'integer'}},
        'required': ['n'],
      },
      lambda n: str(n + 1),
    ),
  ]


@pytest.fixture
def runner():
  r = ToolRunner(_tools(), timeout_s=0.3, max_chars=100)
  yield r
  _RELEASE.set()
  r.close()


def test_every_failure_is_contained_and_counted(runner):
  cases = [
    ('ok', {}, 'ok', 'fine'),
    ('number', {}, 'ok', '42'),
    ('raises', {}, 'error', 'error: RuntimeError: boom'),
    ('hangs', {}, 'timeout', 'error: hangs timed out'),
    ('garbage', {}, 'garbage', 'error: garbage returned no usable text'),
    ('huge', {}, 'garbage', 'error: huge returned no usable text'),
    ('nope', {}, 'unknown', "error: unknown tool 'nope'"),
    ('typed', {'n': 'one'}, 'arguments', 'error: typed:'),
    ('typed', {}, 'arguments', 'error: typed:'),
    ('typed', {'n': 1}, 'ok', '2'),
  ]
  for name, args, outcome, content in cases:
    got, how = runner.run(ToolCall(name, args))
    assert how == outcome, (name, got)
    assert got.startswith(content), (name, got)
  counts = runner.take_counts()
  assert counts == {
    'ok': 3,
    'unknown': 1,
    'arguments': 2,
    'error': 1,
    'timeout': 1,
    'garbage': 2,
  }
  assert sum(runner.take_counts().values()) == 0  # taken


def test_bad_schema_is_refused_at_definition():
  with pytest.raises(ValueError, match="type 'object'"):
    Tool('t', 'd', {'type': 'string'}, lambda: '')
  with pytest.raises(ValueError, match='invalid parameters schema'):
    Tool('t', 'd', {'type': 'object', 'properties': 3}, lambda: '')
