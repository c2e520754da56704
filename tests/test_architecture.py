"""The import graph of `jaxcorr/` (docs/architecture.md, "Layers"): no
module cycle, every package arrow points down the layer table, one import
path per public name (no re-export shims), no folder over 20 modules.

Every import counts: module level, inside functions, and under
`TYPE_CHECKING`, because each is an arrow a reader has to follow.
"""

from __future__ import annotations

import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / 'jaxcorr'

LAYERS: tuple[tuple[str, ...], ...] = (
  ('jaxcorr.config', 'jaxcorr.console', 'jaxcorr.sandbox'),
  ('jaxcorr.losses',),
  ('jaxcorr.sharding', 'jaxcorr.distributed'),
  ('jaxcorr.sampling',),
  ('jaxcorr.model',),
  ('jaxcorr.rollout',),
  ('jaxcorr.data', 'jaxcorr.rewards'),
  ('jaxcorr.agents', 'jaxcorr.judge', 'jaxcorr.endpoint', 'jaxcorr.hubs'),
  ('jaxcorr.train',),
  (
    'jaxcorr.lab',
    'jaxcorr.dashboard',
    'jaxcorr.parity',
    'jaxcorr.plan',
    'jaxcorr.main',
    'jaxcorr.evaluate',
    'jaxcorr.export',
    'jaxcorr.serve',
    'jaxcorr.convert',
    'jaxcorr.demo',
  ),
)
"""Bottom to top: a package may import its own layer's peers (acyclically)
and the layers below it, never a layer above."""

MAX_MODULES_PER_FOLDER = 20


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in sorted(PACKAGE.rglob('*.py')):
    parts = path.relative_to(ROOT).with_suffix('').parts
    if parts[-1] == '__init__':
      parts = parts[:-1]
    out['.'.join(parts)] = path
  return out


MODULES = _modules()


def _owner(name: str) -> str:
  """The module `name` lives in (`pkg.mod.Name` -> `pkg.mod`)."""
  while name and name not in MODULES:
    name = name.rpartition('.')[0]
  return name


def _imports(module: str) -> list[tuple[str, str | None]]:
  """(imported module, imported name or None) for every jaxcorr import."""
  path = MODULES[module]
  tree = ast.parse(path.read_text(encoding='utf-8'), str(path))
  package = module if path.name == '__init__.py' else module.rpartition('.')[0]
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out += [
        (a.name, None) for a in node.names if a.name.startswith('jaxcorr')
      ]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:
        anchor = package
        for _ in range(node.level - 1):
          anchor = anchor.rpartition('.')[0]
        base = f'{anchor}.{base}' if base else anchor
      if base.startswith('jaxcorr'):
        out += [(base, a.name) for a in node.names]
  return out


def _edges() -> dict[str, set[str]]:
  edges = collections.defaultdict(set)
  for module in MODULES:
    for base, name in _imports(module):
      full = f'{base}.{name}' if name else base
      target = _owner(full) if full in MODULES else _owner(base)
      if target and target != module:
        edges[module].add(target)
  return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one node (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(edges.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  nodes = set(edges) | {w for ws in edges.values() for w in ws}
  for v in sorted(nodes):
    if v not in index:
      visit(v)
  return found


def _layer(module: str) -> int:
  for i, members in enumerate(LAYERS):
    if any(module == m or module.startswith(m + '.') for m in members):
      return i
  raise AssertionError(f'{module} is in no layer of LAYERS: add it')


def _package(module: str) -> str:
  return '.'.join(module.split('.')[:2])


def test_every_module_has_a_layer():
  for module in MODULES:
    if module != 'jaxcorr':
      _layer(module)


def test_no_module_or_package_cycle():
  edges = _edges()
  assert _cycles(edges) == [], 'module cycles'
  packages = collections.defaultdict(set)
  for a, targets in edges.items():
    for b in targets:
      if _package(a) != _package(b):
        packages[_package(a)].add(_package(b))
  assert _cycles(packages) == [], 'package cycles'


def test_no_arrow_points_up_the_layers():
  up = [
    f'{a} -> {b}'
    for a, targets in _edges().items()
    for b in targets
    if a != 'jaxcorr' and _layer(b) > _layer(a)
  ]
  assert not up, 'imports up the layer table:\n' + '\n'.join(sorted(up))


def _defined_names(module: str) -> set[str]:
  """Top-level names a module defines itself (not ones it imports)."""
  tree = ast.parse(MODULES[module].read_text(encoding='utf-8'))
  names = set()
  for node in tree.body:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
      names.add(node.name)
    elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      for t in targets:
        names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    elif isinstance(node, ast.If | ast.Try):  # guarded definitions
      for sub in ast.walk(node):
        if isinstance(sub, ast.FunctionDef | ast.ClassDef):
          names.add(sub.name)
        elif isinstance(sub, ast.Assign):
          for t in sub.targets:
            names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
  return names


def _faces() -> dict[str, set[str]]:
  """Package faces: `__init__` modules with `__all__`, and their names."""
  out = {}
  for module, path in MODULES.items():
    if path.name != '__init__.py':
      continue
    for node in ast.parse(path.read_text(encoding='utf-8')).body:
      if isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == '__all__' for t in node.targets
      ):
        out[module] = set(ast.literal_eval(node.value))
  return out


def test_one_import_path_per_name():
  """A name is imported from the module that defines it, or from its
  package's face; never through a module that merely imports it, and
  never around a face from outside its package."""
  faces = _faces()
  face_of = {}  # defining module -> (face, names)
  for face, names in faces.items():
    for base, name in _imports(face):
      if name in names:
        face_of.setdefault(_owner(base), (face, set()))[1].add(name)
  wrong = []
  for module in MODULES:
    for base, name in _imports(module):
      if name is None or f'{base}.{name}' in MODULES:
        continue
      if base not in MODULES:
        wrong.append(f'{module}: from {base} import {name} (no such module)')
      elif base in faces and name in faces[base]:
        continue
      elif name not in _defined_names(base):
        wrong.append(f'{module}: {name} is not defined in {base}')
      elif base in face_of and name in face_of[base][1]:
        face = face_of[base][0]
        if module != face and not module.startswith(face + '.'):
          wrong.append(f'{module}: import {name} from the face {face}')
  assert not wrong, 'second import paths:\n' + '\n'.join(sorted(wrong))


def test_no_re_export_shims():
  found = [
    f'{path.relative_to(ROOT)}:{i}'
    for path in sorted(PACKAGE.rglob('*.py'))
    for i, line in enumerate(path.read_text().splitlines(), 1)
    if 'noqa: F401' in line and 'jaxcorr' in line
  ]
  assert not found, 're-export shims (noqa: F401): ' + ', '.join(found)


def test_no_folder_over_the_module_limit():
  counts = collections.Counter(p.parent for p in PACKAGE.rglob('*.py'))
  big = {
    str(d.relative_to(ROOT)): n
    for d, n in counts.items()
    if n - ((d / '__init__.py').exists()) > MAX_MODULES_PER_FOLDER
  }
  assert not big, f'folders over {MAX_MODULES_PER_FOLDER} modules: {big}'


def test_the_checks_can_fail():
  """The cycle finder and the layer table catch what they claim to."""
  assert _cycles({'a': {'b'}, 'b': {'a'}}) == [['a', 'b']]
  assert _cycles({'a': {'b'}, 'b': set()}) == []
  assert _layer('jaxcorr.train.loop') > _layer('jaxcorr.config.fields')
