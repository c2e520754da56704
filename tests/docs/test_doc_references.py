"""Every documentation reference in the repository resolves.

The syntax is defined in docs/math/README.md §5. In short: `.py` files under
jaxcorr/, configs/, bench/ and tests/ cite a document by its repo-relative
path (`docs/math/losses.md`) and a section right after it
(`docs/math/losses.md §4.4`, `docs/math/advantages.md §6–§8`); a `§` that
follows no path and a bare `name.md` are errors. `.md` files (README.md and
docs/) must link to existing files, and a `§` after a link or path, or a bare
`§` (same page), must be a heading of that page.

This file is not scanned itself: its fixtures are deliberately bad references.
"""

from __future__ import annotations

import functools
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PY_DIRS = ('jaxcorr', 'configs', 'bench', 'tests')
OUTPUT_FILES = frozenset({'results.md', 'exact.md'})
"""`.md` names of files the code writes, not documents it cites."""

SECTION = r'§\d+(?:\.\d+)*'
_SEP = r'(?:,[ \t]*|[ \t]+(?:and|or)[ \t]+|[ \t]*[-–][ \t]*)'
SECTIONS = rf'{SECTION}(?:{_SEP}{SECTION})*'
# A path needs a directory part; `(?<!...)` keeps it from starting mid-word.
PATH = r'(?<![\w./-])((?:[\w.-]+/)+[\w.-]+\.md)(?![\w/-])'
BARE_NAME = r'(?<![\w./-])([\w-]+\.md)(?![\w/-])'
# Between a path and its sections: an optional closing backtick, then blanks,
# possibly one line break (with a comment's `#` on the next line).
_GAP = r'`?(?:[ \t]+|[ \t]*\n[ \t]*(?:#[ \t]*)?)'
PY_REF = re.compile(rf'{PATH}(?:{_GAP}({SECTIONS}))?')
MD_LINK = re.compile(r'\[[^\]\n]*\]\(([^)\s]+)\)' + rf'(?:[ \t]+({SECTIONS}))?')
MD_PATH = re.compile(rf'{PATH}`?(?:[ \t]+({SECTIONS}))?')
SECTION_RE = re.compile(SECTION)
SECTION_MARK = re.compile(r'§(?:\w+(?:\.\w+)*)?')
HEADING = re.compile(
  r'^#{1,6}[ \t]+(?:§(\d+(?:\.\d+)*)|(\d+(?:\.\d+)*)\.?[ \t])'
)
FENCE = re.compile(r'^[ \t]*```')
INLINE_CODE = re.compile(r'`[^`\n]+`')


@functools.cache
def headings(path: pathlib.Path) -> frozenset[str]:
  """Section numbers of a markdown file: `## §4.4 …` or `## 4.4 …` headings."""
  found = set()
  for line in _outside_fences(path.read_text(encoding='utf-8')):
    m = HEADING.match(line)
    if m:
      found.add(m.group(1) or m.group(2))
  return frozenset(found)


def _outside_fences(text: str) -> list[str]:
  """The lines of `text`, with fenced code blocks blanked (line numbers kept)."""
  out, fenced = [], False
  for line in text.split('\n'):
    if FENCE.match(line):
      fenced = not fenced
      out.append('')
    else:
      out.append('' if fenced else line)
  return out


def _line(text: str, pos: int) -> int:
  return text.count('\n', 0, pos) + 1


def _check_sections(
  target: pathlib.Path, sections: str | None, where: str
) -> list[str]:
  if not sections:
    return []
  if target.suffix != '.md' or not target.is_file():
    return [f'{where}: sections {sections!r} cite a non-document {target}']
  known = headings(target)
  return [
    f'{where}: {s} is not a heading of {target.relative_to(ROOT)}'
    for s in SECTION_RE.findall(sections)
    if s[1:] not in known
  ]


def _bare_marks(text: str, used: list[tuple[int, int]], rel: str, why: str):
  problems = []
  for m in SECTION_MARK.finditer(text):
    if not any(a <= m.start() < b for a, b in used):
      problems.append(f'{rel}:{_line(text, m.start())}: {m.group()!r} {why}')
  return problems


def check_python_text(text: str, rel: str) -> list[str]:
  """Problems with the references in the text of one `.py` file."""
  problems, used = [], []
  for m in PY_REF.finditer(text):
    where = f'{rel}:{_line(text, m.start())}'
    target = ROOT / m.group(1)
    if not target.is_file():
      problems.append(f'{where}: {m.group(1)} does not exist in the repo')
    else:
      problems += _check_sections(target, m.group(2), where)
    if m.group(2):
      used.append((m.start(2), m.end(2)))
  problems += _bare_marks(
    text, used, rel, 'follows no document path (write `docs/…/x.md §N`)'
  )
  for m in re.finditer(BARE_NAME, text):
    if m.group(1) not in OUTPUT_FILES:
      problems.append(
        f'{rel}:{_line(text, m.start())}: bare file name {m.group(1)!r}; '
        'write its repo-relative path'
      )
  return problems


def check_markdown_text(text: str, rel: str) -> list[str]:
  """Problems with the links and sections in the text of one `.md` file."""
  page = ROOT / rel
  text = '\n'.join(_outside_fences(text))
  problems, links = [], []
  # Inline code shows syntax (`[text](target)`, `§N`) and is not a link or a
  # section of this page; paths in it are still checked below.
  used = [m.span() for m in INLINE_CODE.finditer(text)]
  for m in MD_LINK.finditer(text):
    links.append(m.span(1))
    if any(a <= m.start() < b for a, b in used):
      continue
    where = f'{rel}:{_line(text, m.start())}'
    url = m.group(1)
    if '://' in url or url.startswith(('#', 'mailto:')):
      continue
    target = (page.parent / url.split('#', 1)[0]).resolve()
    if not target.exists():
      problems.append(f'{where}: link target {url} does not exist')
    else:
      problems += _check_sections(target, m.group(2), where)
    if m.group(2):
      used.append((m.start(2), m.end(2)))
  for m in MD_PATH.finditer(text):
    if any(a <= m.start() < b for a, b in links):
      continue
    where = f'{rel}:{_line(text, m.start())}'
    target = ROOT / m.group(1)
    if not target.is_file():
      problems.append(f'{where}: {m.group(1)} does not exist in the repo')
    else:
      problems += _check_sections(target, m.group(2), where)
    if m.group(2):
      used.append((m.start(2), m.end(2)))
  known = headings(page) if page.is_file() else frozenset()
  for m in SECTION_MARK.finditer(text):
    if any(a <= m.start() < b for a, b in used):
      continue
    number = SECTION_RE.match(m.group())
    if number is None or number.group()[1:] not in known:
      problems.append(
        f'{rel}:{_line(text, m.start())}: {m.group()!r} is not a heading of '
        'this page (cite another page as [name](path) §N)'
      )
  return problems


def python_files() -> list[pathlib.Path]:
  own = pathlib.Path(__file__).resolve()
  files = []
  for top in PY_DIRS:
    files += [p for p in sorted((ROOT / top).rglob('*.py')) if p != own]
  return files


def markdown_files() -> list[pathlib.Path]:
  return [ROOT / 'README.md', *sorted((ROOT / 'docs').rglob('*.md'))]


def _rel(path: pathlib.Path) -> str:
  return str(path.relative_to(ROOT))


# ------------------------------------------------------------- the repo


def test_python_references_resolve():
  files = python_files()
  assert len(files) > 50, 'the scan found too few files; wrong ROOT?'
  problems = []
  for path in files:
    problems += check_python_text(path.read_text(encoding='utf-8'), _rel(path))
  assert not problems, '\n'.join(
    [f'{len(problems)} unresolved references:', *problems]
  )


def test_markdown_references_resolve():
  problems = []
  for path in markdown_files():
    problems += check_markdown_text(
      path.read_text(encoding='utf-8'), _rel(path)
    )
  assert not problems, '\n'.join(
    [f'{len(problems)} unresolved references:', *problems]
  )


def test_math_pages_have_their_sections():
  # The numbering the code cites: every page keeps the sections it was
  # written with, so existing references keep their meaning.
  expected = {
    'README.md': 6,
    'rollout_contract.md': 8,
    'correction.md': 9,
    'losses.md': 8,
    'advantages.md': 9,
  }
  for name, top in expected.items():
    found = headings(ROOT / 'docs' / 'math' / name)
    assert {str(i) for i in range(1, top + 1)} <= found, name
  assert {f'4.{i}' for i in range(1, 8)} <= headings(
    ROOT / 'docs/math/correction.md'
  )
  assert {f'4.{i}' for i in range(1, 5)} <= headings(
    ROOT / 'docs/math/losses.md'
  )


# ----------------------------------------------------- the checker itself

S = '\u00a7'  # written escaped so that the fixtures below stay readable


@pytest.mark.parametrize(
  'text',
  [
    f'"""See docs/math/losses.md {S}4.4."""',
    f'# docs/math/advantages.md {S}6–{S}8 and docs/math/losses.md {S}2',
    f'"""(`docs/math/rollout_contract.md`\n{S}1-{S}2): the rule."""',
    f'# knobs (docs/math/losses.md\n# {S}4.4, {S}5)',
    f'"""`docs/math/correction.md` {S}3 or {S}8; docs/correction.md {S}3."""',
    "out = 'results.md'",
    '"""No reference here."""',
  ],
)
def test_checker_accepts_good_references(text):
  assert check_python_text(text, 'x.py') == []


@pytest.mark.parametrize(
  ('text', 'needle'),
  [
    (f'"""docs/math/losses.md {S}4.9"""', '4.9 is not a heading'),
    (f'"""docs/math/losses.md {S}4.4–{S}9"""', '9 is not a heading'),
    (f'"""losses.md {S}4.4"""', 'bare file name'),
    (f'"""losses.md {S}4.4"""', 'follows no document path'),
    (f'"""(spec {S}3)"""', 'follows no document path'),
    (f'"""rollout contract {S}1"""', 'follows no document path'),
    ('"""docs/math/nothing.md"""', 'does not exist'),
    ('"""shared/spec/losses.md"""', 'does not exist'),
    (f'"""docs/correction.md {S}metrics"""', 'follows no document path'),
    (f'"""docs/correction.md {S}7"""', '7 is not a heading'),
  ],
)
def test_checker_rejects_bad_references(text, needle):
  problems = check_python_text(text, 'x.py')
  assert any(needle in p for p in problems), problems


def test_checker_reports_every_problem_with_its_line():
  text = f'"""ok docs/math/losses.md {S}2\n\nbad {S}3\nbad losses.md\n"""'
  problems = check_python_text(text, 'pkg/mod.py')
  assert len(problems) == 2, problems
  assert problems[0].startswith('pkg/mod.py:3:')
  assert problems[1].startswith('pkg/mod.py:4:')


def test_markdown_checker():
  rel = 'docs/math/losses.md'
  good = (
    f'See [x](correction.md) {S}4.4, [y](../../jaxcorr/losses/kl.py), '
    f'[u](https://example.com), {S}4.1 here, docs/math/README.md {S}5.\n'
    f'Syntax in code is not checked: `{S}N`, `[t](nowhere.md)`.\n'
    f'```\n{S}99 in a fence is code\n```\n'
  )
  assert check_markdown_text(good, rel) == []
  bad = {
    '[x](missing.md)': 'does not exist',
    f'[x](correction.md) {S}10': '10 is not a heading',
    f'{S}42 on its own': 'not a heading of this page',
    'shared/spec/losses.md': 'does not exist in the repo',
    '`shared/spec/losses.md`': 'does not exist in the repo',
  }
  for text, needle in bad.items():
    problems = check_markdown_text(text, rel)
    assert any(needle in p for p in problems), (text, problems)
