"""Collective traffic of a compiled program, read from its optimised HLO.

`collective_bytes(hlo_text)` sums, per kind (all-reduce, all-gather,
reduce-scatter, all-to-all, collective-permute), the bytes of the operands
each device hands to the collective and of the results it gets back,
counting an instruction as many times as it runs in one call: a `while`
body counts `known_trip_count` times (XLA records it for `lax.scan` and
`fori_loop` loops), nested loops multiply, and a loop whose count XLA does
not know (a `lax.while_loop` that may exit early) counts `loop_bound`
times (the caller's bound, e.g. a decode chunk's steps; once when None;
`unknown_loops` says how many there were), a loop condition counts as
often as its body, and both branches of a conditional count (upper
bounds).

XLA has no API for this, and the numbers are what the SPMD partitioner
inserted for this mesh, so the text of `compiled.as_text()` is the source.
"""

from __future__ import annotations

import collections
import dataclasses
import re

KINDS = (
  'all-reduce',
  'all-gather',
  'reduce-scatter',
  'all-to-all',
  'collective-permute',
)

_BYTES = {
  'pred': 1,
  's8': 1,
  'u8': 1,
  'f8e4m3fn': 1,
  'f8e5m2': 1,
  's16': 2,
  'u16': 2,
  'f16': 2,
  'bf16': 2,
  's32': 4,
  'u32': 4,
  'f32': 4,
  's64': 8,
  'u64': 8,
  'f64': 8,
  'c64': 8,
  'c128': 16,
}
_ARRAY = re.compile(r'\b([a-z][a-z0-9]*)\[([0-9,]*)\]')
_COMPUTATION = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$')
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$')
_OPCODE = re.compile(
  r'^(\([^=]*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+([a-z\-]+)\((.*)$'
)
_COMMENT = re.compile(r'/\*.*?\*/')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLS = re.compile(
  r'\b(body|condition|to_apply|calls|true_computation|false_computation)'
  r'=%?([\w.\-]+)'
)
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string (an array or a tuple of arrays)."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    n = 1
    for d in filter(None, dims.split(',')):
      n *= int(d)
    total += n * _BYTES.get(dtype, 4)
  return total


@dataclasses.dataclass
class KindTraffic:
  """One collective kind in one call of a program."""

  count: int = 0  # instructions executed
  operand_bytes: int = 0  # per device, what it contributes
  result_bytes: int = 0  # per device, what it gets back


@dataclasses.dataclass
class Traffic:
  """Collective traffic per device of one call (module docstring)."""

  kinds: dict[str, KindTraffic]
  unknown_loops: int

  @property
  def total_operand_bytes(self) -> int:
    return sum(k.operand_bytes for k in self.kinds.values())

  @property
  def total_result_bytes(self) -> int:
    return sum(k.result_bytes for k in self.kinds.values())


@dataclasses.dataclass
class _Instruction:
  name: str
  shape: str
  opcode: str
  operands: list[str]
  rest: str


def _split_operands(text: str) -> tuple[list[str], str]:
  """'a, b), attrs' -> (['a', 'b'], 'attrs')."""
  depth, i = 1, 0
  while i < len(text) and depth:
    depth += {'(': 1, ')': -1}.get(text[i], 0)
    i += 1
  inner, rest = text[: i - 1], text[i:]
  names = re.findall(r'%([\w.\-]+)', inner)
  return names, rest


def _parse(hlo: str) -> tuple[dict[str, list[_Instruction]], str]:
  """Computations by name, and the entry's name."""
  comps: dict[str, list[_Instruction]] = {}
  entry, current = '', None
  for line in hlo.splitlines():
    line = _COMMENT.sub('', line)
    m = _COMPUTATION.match(line)
    if m:
      current = comps.setdefault(m.group(1), [])
      if line.startswith('ENTRY'):
        entry = m.group(1)
      continue
    if current is None:
      continue
    if line.strip() == '}':
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    op = _OPCODE.match(m.group(2))
    if not op:
      continue
    operands, rest = _split_operands(op.group(3))
    current.append(
      _Instruction(m.group(1), op.group(1), op.group(2), operands, rest)
    )
  return comps, entry


def _kind(opcode: str) -> str | None:
  """The collective kind of an opcode ('all-gather-start' counts as an
  all-gather; '-done' halves are not counted again)."""
  if opcode.endswith('-done'):
    return None
  base = opcode.removesuffix('-start')
  return base if base in KINDS else None


def collective_bytes(hlo: str, loop_bound: int | None = None) -> Traffic:
  """Per-kind collective traffic of one call of the compiled module `hlo`
  (`compiled.as_text()`); `loop_bound`: how often a loop of unknown trip
  count runs (module docstring)."""
  comps, entry = _parse(hlo)
  times: dict[str, int] = collections.Counter()
  unknown = 0

  def visit(name: str, mult: int) -> None:
    nonlocal unknown
    times[name] += mult
    for ins in comps.get(name, ()):
      if ins.opcode == 'fusion' or _kind(ins.opcode):
        continue  # fused code and reducers hold no collectives
      children = [c for _, c in _CALLS.findall(ins.rest)]
      for group in _BRANCHES.findall(ins.rest):
        children += re.findall(r'%?([\w.\-]+)', group)
      n = 1
      if ins.opcode == 'while':
        trip = _TRIP.search(ins.rest)
        if trip:
          n = int(trip.group(1))
        else:
          unknown += 1
          n = loop_bound or 1
      for child in children:
        if child in comps:
          visit(child, mult * n)

  if entry:
    visit(entry, 1)
  kinds = {k: KindTraffic() for k in KINDS}
  for name, mult in times.items():
    shapes = {ins.name: ins.shape for ins in comps[name]}
    for ins in comps[name]:
      kind = _kind(ins.opcode)
      if kind is None:
        continue
      t = kinds[kind]
      t.count += mult
      operand = sum(shape_bytes(shapes.get(o, '')) for o in ins.operands)
      result = shape_bytes(ins.shape)
      if ins.opcode.endswith('-start'):
        # An async start's result is (operands, results): keep the results.
        result = max(result - operand, 0)
      t.operand_bytes += mult * operand
      t.result_bytes += mult * result
  return Traffic(kinds, unknown)
