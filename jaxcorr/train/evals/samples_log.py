"""The JSONL of eval samples: every reply of an eval step, one JSON object
per line, in `<workdir>/eval_samples/step_<N>.jsonl` (process i > 0 of a
multi-process run: `step_<N>.process_<i>.jsonl`, its share of the prompts).

Each row: `step`, `set` (the eval set's name, '' for the default set),
`mode` ('greedy' or 'sampled'), `prompt_index` (in this process's share of
the set), `sample` (0 for greedy; 0..n-1 for sampled), `prompt` (as the
model saw it, the template applied), `answer` (the reference), `reply`,
`reward` (the weighted sum of the reward functions, what training would
use) and `score` (the first reward function's value: accuracy's).

A step evaluated again (a resumed run) rewrites its file.

Text stays UTF-8 as written (`ensure_ascii=False`), except the characters
that line splitters other than JSON Lines' `\n` break lines at: U+2028,
U+2029 and U+0085 (Python's `str.splitlines`, JavaScript) are written as
`\u2028` escapes, as are surrogates (UTF-8 cannot hold them: the write
would fail), so every row is one physical line for any reader and any
string of characters reads back as written. `read` splits on `\n` only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

import jax
from etils import epath

DIRNAME = 'eval_samples'

# Only ever inside a JSON string here (JSON whitespace is ASCII), where a
# \uXXXX escape reads back as the same character.
_ESCAPED = re.compile('[\u2028\u2029\x85\ud800-\udfff]')


def _line(row: dict) -> str:
  """One JSON line of `row` (module doc)."""
  text = json.dumps(row, ensure_ascii=False)
  return _ESCAPED.sub(lambda m: f'\\u{ord(m.group()):04x}', text) + '\n'


def path(directory: str, step: int) -> str:
  """This process's file of eval step `step` under `directory`."""
  index = jax.process_index()
  tail = f'.process_{index}' if index else ''
  return str(epath.Path(directory) / f'step_{step}{tail}.jsonl')


def write(directory: str, step: int, rows: Iterable[dict]) -> str:
  """Writes the rows of eval step `step` (a temporary file, then a rename,
  so a reader never sees half a file; local or `gs://`); returns the path."""
  epath.Path(directory).mkdir(parents=True, exist_ok=True)
  out = epath.Path(path(directory, step))
  tmp = out.parent / f'{out.name}.tmp'
  text = ''.join(_line(r) for r in rows)
  tmp.write_text(text, encoding='utf-8')
  tmp.replace(out)
  return str(out)


def read(directory: str, step: int) -> list[dict]:
  """The rows of eval step `step` (this process's file)."""
  text = epath.Path(path(directory, step)).read_text(encoding='utf-8')
  return [json.loads(line) for line in text.split('\n') if line.strip()]
