"""The house-style size limits: no file over 500 lines, no class over 250,
no function over 80, in the library (`jaxcorr/`) and the configs
(`configs/`), so that a unit does one thing and reads in one sitting.
Benchmarks and tests are exempt. A unit spans its decorators, docstring and
body; nested functions and methods count on their own too.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ('jaxcorr', 'configs')
LIMITS = {'file': 500, 'class': 250, 'function': 80}


def _sources() -> list[str]:
  """The tracked `.py` files of PACKAGES (every file on disk without git)."""
  try:
    out = subprocess.run(
      ['git', 'ls-files', '--', *PACKAGES],
      cwd=ROOT,
      capture_output=True,
      text=True,
      check=True,
    ).stdout.split()
  except (OSError, subprocess.CalledProcessError):
    out = []
  if not out:
    out = [
      str(p.relative_to(ROOT))
      for pkg in PACKAGES
      for p in (ROOT / pkg).rglob('*')
    ]
  return sorted(p for p in out if p.endswith('.py'))


def oversized(source: str, path: str) -> list[str]:
  """`path:line kind name: N lines > limit` for every unit over its limit."""
  lines = len(source.splitlines())
  found = []
  if lines > LIMITS['file']:
    found.append(f'{path}: file {lines} lines > {LIMITS["file"]}')
  for node in ast.walk(ast.parse(source, path)):
    if isinstance(node, ast.ClassDef):
      kind = 'class'
    elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
      kind = 'function'
    else:
      continue
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    n = node.end_lineno - start + 1
    if n > LIMITS[kind]:
      found.append(
        f'{path}:{node.lineno}: {kind} {node.name} {n} lines > {LIMITS[kind]}'
      )
  return found


def test_sources_are_found():
  files = _sources()
  assert 'jaxcorr/losses/objective.py' in files
  assert any(f.startswith('configs/') for f in files)


def test_no_file_class_or_function_over_the_limits():
  found = []
  for path in _sources():
    found += oversized((ROOT / path).read_text(encoding='utf-8'), path)
  assert not found, 'over the house-style size limits:\n' + '\n'.join(found)


@pytest.mark.parametrize(
  'source, want',
  [
    ('def f():\n' + '  x = 1\n' * 80, 'function f 81 lines > 80'),
    ('@dec\ndef f():\n' + '  x = 1\n' * 79, 'function f 81 lines > 80'),
    ('class C:\n' + '  x = 1\n' * 250, 'class C 251 lines > 250'),
    ('class C:\n  def m(self):\n' + '    x = 1\n' * 80, 'function m 81'),
    ('x = 1\n' * 501, 'file 501 lines > 500'),
  ],
)
def test_oversized_names_the_offender(source, want):
  found = oversized(source, 'pkg/mod.py')
  assert len(found) == 1 and want in found[0], found


def test_units_at_the_limits_pass():
  assert oversized('def f():\n' + '  x = 1\n' * 79, 'a.py') == []
  assert oversized('class C:\n' + '  x = 1\n' * 249, 'a.py') == []
  assert oversized('x = 1\n' * 500, 'a.py') == []
