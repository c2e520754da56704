"""Reads the golden vectors copied into `tests/golden/<framework>/`.

Each framework folder holds `index.json` (cases) and `golden.npz` (arrays),
in the `jaxcorr-golden/1` format described in docs/math/README.md §6. The
data was produced by running verl, SkyRL, slime and prime-rl; this module only
decodes it (numpy + json).

    gs = golden_data.load('verl')
    for case in gs.cases(group='rs_grid'):
      kw = gs.kwargs(case)      # arrays resolved, configs expanded (flat)
      out = gs.outputs(case)    # name -> ndarray | list | value | None
"""

from __future__ import annotations

import copy
import functools
import json
import math
import pathlib
from collections.abc import Iterator
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1] / 'golden'
FRAMEWORKS = ('verl', 'skyrl', 'slime', 'prime')
_SPECIAL = {'NaN': math.nan, 'Infinity': math.inf, '-Infinity': -math.inf}


def decode(value: Any) -> Any:
  """JSON's "NaN"/"Infinity"/"-Infinity" strings back to floats."""
  if isinstance(value, str):
    return _SPECIAL.get(value, value)
  if isinstance(value, list):
    return [decode(v) for v in value]
  if isinstance(value, dict):
    return {k: decode(v) for k, v in value.items()}
  return value


def _is_config(node: Any) -> bool:
  return isinstance(node, dict) and '$config' in node and 'fields' in node


class GoldenSet:
  """One framework's cases and arrays."""

  def __init__(self, folder: pathlib.Path):
    self.index = json.loads((folder / 'index.json').read_text())
    self.npz = np.load(folder / 'golden.npz', allow_pickle=False)
    self.framework: str = self.index['framework']
    self.meta: dict = self.index['meta']
    self.defaults: dict = self.index.get('config_defaults', {})
    self._by_id = {c['id']: c for c in self.index['cases']}

  def cases(
    self,
    group: str | None = None,
    prefix: str | None = None,
    errors: bool | None = None,
  ) -> Iterator[dict]:
    for c in self.index['cases']:
      if group is not None and c.get('group') != group:
        continue
      if prefix is not None and not c['id'].startswith(prefix):
        continue
      if errors is not None and (c.get('error') is not None) != errors:
        continue
      yield c

  def case(self, case_id: str) -> dict:
    return self._by_id[case_id]

  def dataset(self, name: str = 'main') -> dict[str, np.ndarray]:
    arrays = self.index['datasets'][name]['arrays']
    return {k: self.npz[key] for k, key in arrays.items()}

  def array(self, key: str) -> np.ndarray:
    return self.npz[key]

  # ------------------------------------------------------------- configs
  def _merge(self, base: Any, part: Any) -> Any:
    if _is_config(part):
      name = part['$config']
      if not (_is_config(base) and base['$config'] == name):
        base = self.defaults[name]
      fields = copy.deepcopy(base['fields'])
      for k, v in part['fields'].items():
        fields[k] = self._merge(fields.get(k), v)
      return {'$config': name, 'fields': fields}
    if isinstance(part, dict) and isinstance(base, dict):
      out = copy.deepcopy(base)
      for k, v in part.items():
        out[k] = self._merge(out.get(k), v)
      return out
    return copy.deepcopy(part)

  @staticmethod
  def _flatten(node: Any) -> Any:
    if _is_config(node):
      out = {'$config': node['$config']}
      out.update({k: GoldenSet._flatten(v) for k, v in node['fields'].items()})
      return out
    if isinstance(node, dict):
      return {k: GoldenSet._flatten(v) for k, v in node.items()}
    if isinstance(node, list):
      return [GoldenSet._flatten(v) for v in node]
    return node

  def expand_config(self, node: dict) -> dict:
    return self._flatten(self._merge(None, node))

  # --------------------------------------------------------------- values
  def _resolve(self, value: Any) -> Any:
    if isinstance(value, dict):
      if '$array' in value:
        arr = self.npz[value['$array']]
        return arr.astype(bool) if value.get('as_dtype') == 'bool' else arr
      if _is_config(value):
        return self.expand_config(value)
      return {k: self._resolve(v) for k, v in value.items()}
    if isinstance(value, list):
      return [self._resolve(v) for v in value]
    return value

  def kwargs(self, case: dict) -> dict:
    """Every argument: literals, expanded configs, tensors as arrays."""
    out = self._resolve(case.get('kwargs', {}))
    for k, key in case.get('tensor_args', {}).items():
      out[k] = self.npz[key]
    return out

  def outputs(self, case: dict) -> dict[str, Any]:
    res = {}
    for name, desc in case.get('outputs', {}).items():
      if desc is None:
        res[name] = None
      elif 'npz' in desc:
        res[name] = self.npz[desc['npz']]
      elif 'npz_list' in desc:
        res[name] = [self.npz[k] for k in desc['npz_list']]
      else:
        res[name] = decode(desc.get('value'))
    return res

  def metrics(self, case: dict) -> dict[str, float] | None:
    if case.get('metrics') is not None:
      return decode(case['metrics'])
    desc = case.get('outputs', {}).get('metrics')
    if desc is not None and isinstance(desc.get('value'), dict):
      return decode(desc['value'])
    return None

  @staticmethod
  def error(case: dict) -> dict | None:
    return case.get('error')


@functools.cache
def load(framework: str) -> GoldenSet:
  return GoldenSet(ROOT / framework)


def case_params(framework: str, **filters) -> list:
  """`pytest.param`s over matching cases, id'd by case and marked `golden`.

  The `golden(framework)` mark feeds the per-framework conformance summary
  printed at the end of the run (see `conftest.py`).
  """
  import pytest

  gs = load(framework)
  mark = pytest.mark.golden(framework)
  return [pytest.param(c, id=c['id'], marks=mark) for c in gs.cases(**filters)]
