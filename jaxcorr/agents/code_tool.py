"""`code_tool`: a `Tool` that runs the agent's Python in the sandbox
(`jaxcorr.sandbox.runner`: no network, no view of the trainer's files,
CPU / memory / file-size / process limits, a wall-clock kill) and returns
what it printed.

The observation is the run's stdout, then its stderr after a `stderr:`
line, each cut to `max_chars` (stderr keeps its end: a traceback's last
line says what went wrong), and a last line naming how a run that did
not end well ended (`[timeout]`, `[memory]`, `[output_limit]`, ...), so the
agent can read its own traceback and try again. Each call is a fresh
sandbox: nothing carries over between calls. A sandbox that cannot be
built raises, which the tool runner reports as a tool failure (the host's
fault, not the agent's).
"""

from __future__ import annotations

from jaxcorr.agents.tools import Tool
from jaxcorr.sandbox import runner

TOOL_LIMITS = runner.Limits(timeout_s=5.0, cpu_s=5, max_output=16384)


def _cut(text: str, max_chars: int, *, tail: bool = False) -> str:
  """`text` cut to its first (or, for a traceback, last) `max_chars`."""
  if len(text) <= max_chars:
    return text
  note = f'[... {len(text) - max_chars} more characters]'
  if tail:
    return f'{note}\n{text[-max_chars:]}'
  return f'{text[:max_chars]}\n{note}'


def code_tool(
  limits: runner.Limits = TOOL_LIMITS, max_chars: int = 2000
) -> Tool:
  """The `python` tool: `{"code": "..."}` -> what the code printed."""

  def python(code: str) -> str:
    result = runner.run_python({'main.py': code}, 'main.py', limits)
    if result.status == runner.SETUP:
      raise RuntimeError(f'the code sandbox failed to start: {result.detail}')
    parts = [_cut(result.stdout, max_chars)]
    if result.stderr:
      parts.append('stderr:\n' + _cut(result.stderr, max_chars, tail=True))
    if result.status not in (runner.OK, runner.ERROR):
      parts.append(f'[{result.status}]')
    return '\n'.join(p for p in parts if p) or '[no output]'

  return Tool(
    name='python',
    description=(
      'Run a Python program (standard library only, no network, '
      f'{limits.timeout_s:g} s) and return what it printed.'
    ),
    parameters={
      'type': 'object',
      'properties': {'code': {'type': 'string'}},
      'required': ['code'],
    },
    fn=python,
  )
