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
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import jax
from etils import epath

DIRNAME = 'eval_samples'


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
  text = ''.join(json.dumps(r, ensure_ascii=False) + '\n' for r in rows)
  tmp.write_text(text, encoding='utf-8')
  tmp.replace(out)
  return str(out)


def read(directory: str, step: int) -> list[dict]:
  """The rows of eval step `step` (this process's file)."""
  text = epath.Path(path(directory, step)).read_text(encoding='utf-8')
  return [json.loads(line) for line in text.splitlines() if line.strip()]
