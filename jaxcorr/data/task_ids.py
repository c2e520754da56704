"""Per-row task ids: which task (data source) each prompt came from.

A row's task is its `Example.task`, or the data source's name when the
example names none. The run's task table is fixed at start-up by
`config.data` alone (`task_names`), so the batch carries an int32 index
into it (`RolloutBatch.task_id`, `TrainBatch.task_id`, `[B]`), which
device code can gather with; -1 is a row of a task outside the table (an
evaluation set's prompt, an environment's) and a padding row.

    arithmetic      one task per operator of `data.ops`: add, sub, mul
    reasoning_gym   the task names of `data.task` (a mix's rows each name
                    their own: reasoning-gym's `metadata.source_dataset`)
    jsonl, parquet, code
                    one task, the source's name

The id of a prompt depends on the example only, so it survives whatever
the batch goes through (dynamic sampling's row picks, the async and stream
modes, padding, packing) and a resumed run recomputes it exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxcorr.data.reasoning_gym import parse_tasks
from jaxcorr.data.tasks import OP_TASKS, Example

NO_TASK = -1


def task_names(data: Any) -> tuple[str, ...]:
  """The task table of a `DataConfig` (module doc), in a fixed order."""
  if data.source == 'arithmetic':
    return tuple(dict.fromkeys(OP_TASKS[op] for op in data.ops))
  if data.source == 'reasoning_gym':
    return tuple(name for name, _ in parse_tasks(data.task))
  return (data.source,)


def task_ids(
  examples: Sequence[Example], names: Sequence[str], source: str, repeat: int
) -> np.ndarray:
  """`[len(examples) * repeat]` int32: each example's index in `names`
  (`source` for an example without a task, -1 for one outside `names`),
  repeated for its `repeat` adjacent samples."""
  where = {name: i for i, name in enumerate(names)}
  ids = [where.get(ex.task or source, NO_TASK) for ex in examples]
  return np.repeat(np.asarray(ids, np.int32), repeat)
