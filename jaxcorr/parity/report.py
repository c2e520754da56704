"""The parity report's outputs: one markdown table, one PNG, the JSON.

A record is `{'setting', 'what', 'model', 'seconds', 'bands'}` with
`bands` from `parity_bands` (empty, with an `'error'` line, for a setting
that failed). `write(records, out)` writes
`results.json`, `results.md` (the table) and `parity.png` (matplotlib,
imported only here) into `out`, each atomically.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from jaxcorr.parity.bands import BANDS

_LABELS = [label for label, _ in BANDS]
COLUMNS = (
  ('tokens', 'tokens', 0),
  *((f'token_{b}', f'tok ±{b}', 3) for b in _LABELS),
  *((f'seq_{b}', f'seq ±{b}', 3) for b in _LABELS),
  ('max_abs_dlogp', 'max \\|Δ log p\\|', -1),
  ('k3', 'k3', -1),
  ('bitwise', 'bit-equal', 3),
  ('argmax', 'argmax agrees', 3),
)
"""(bands key, column head, digits: ≥ 0 fixed, -1 two significant)."""


def _cell(value: float | None, digits: int) -> str:
  if value is None or (isinstance(value, float) and math.isnan(value)):
    return '–'
  if digits == -1:
    return '0' if value == 0 else f'{value:.2g}'
  return f'{value:.{digits}f}'


def markdown_table(records: Sequence[Mapping[str, Any]]) -> str:
  """One row per record: setting, model, then `COLUMNS`."""
  head = ['setting', 'model', *(h for _, h, _ in COLUMNS)]
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for r in records:
    cells = [f'`{r["setting"]}`', r['model']]
    cells += [_cell(r['bands'].get(k), d) for k, _, d in COLUMNS]
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def settings_table(records: Sequence[Mapping[str, Any]]) -> str:
  """What each setting is, and how long its measurement took."""
  lines = ['| setting | what | seconds |', '|---|---|---|']
  for r in records:
    what = r['what'] + (f' (**failed**: {r["error"]})' if 'error' in r else '')
    lines.append(f'| `{r["setting"]}` | {what} | {r["seconds"]:.0f} |')
  return '\n'.join(lines)


def plot(records: Sequence[Mapping[str, Any]], path: str) -> None:
  """Token retention in each band, bit-equality and argmax agreement per
  setting (left), max |Δ log p| on a log axis (right)."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  names = [f'{r["setting"]} ({r["model"]})' for r in records]
  keys = [*(f'token_{b}' for b in _LABELS), 'bitwise', 'argmax']
  heads = [*(f'|π/μ − 1| ≤ {b}' for b in _LABELS), 'bit-equal', 'argmax']
  fig, (left, right) = plt.subplots(
    1, 2, figsize=(12, 0.45 * len(records) + 1.8), sharey=True,
    gridspec_kw={'width_ratios': [3, 1]},
  )  # fmt: skip
  height = 0.8 / len(keys)
  for j, (key, head) in enumerate(zip(keys, heads)):
    ys = [i + (j - len(keys) / 2) * height for i in range(len(records))]
    xs = [_number(r['bands'].get(key)) for r in records]
    left.barh(ys, xs, height=height, label=head, color=f'C{j}')
  left.set_yticks(range(len(records)), names)
  left.invert_yaxis()
  left.set_xlim(0, 1)
  left.set_xlabel('fraction of response tokens (argmax: greedy positions)')
  left.legend(fontsize=7, loc='lower left', ncol=len(keys))
  gaps = [max(_number(r['bands'].get('max_abs_dlogp')), 1e-9) for r in records]
  right.barh(range(len(records)), gaps, color='C7')
  right.set_xscale('log')
  right.set_xlabel('max |Δ log p| (1e-9: none)')
  for ax in (left, right):
    ax.grid(axis='x', alpha=0.3)
  fig.suptitle('Engine μ vs trainer π_old on the same tokens')
  fig.tight_layout()
  _atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format='png'))
  plt.close(fig)


def _number(x: float | None) -> float:
  return 0.0 if x is None or math.isnan(x) else float(x)


def _atomic(path: str, write) -> None:
  """`write(tmp)` then rename onto `path`: never a half-written file."""
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=folder, suffix='.tmp')
  os.close(fd)
  try:
    write(tmp)
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise


def _text(path: str, text: str) -> None:
  def write(tmp):
    with open(tmp, 'w') as f:
      f.write(text)

  _atomic(path, write)


def write(records: Sequence[Mapping[str, Any]], out: str) -> list[str]:
  """results.json, results.md and parity.png in `out`; their paths."""
  paths = [os.path.join(out, n) for n in ('results.json', 'results.md')]
  _text(paths[0], json.dumps(list(records), indent=1) + '\n')
  md = markdown_table(records) + '\n\n' + settings_table(records) + '\n'
  _text(paths[1], md)
  paths.append(os.path.join(out, 'parity.png'))
  plot(records, paths[2])
  return paths
