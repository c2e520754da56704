"""The named eval sets of `eval.sets`: each set is the data section with a
few fields changed (another task, operand range, eval file, ...), and its
held-out prompts are `jaxcorr.data.prompts.make_eval_source` of that.

Each process evaluates its equal, contiguous share of a set's prompts (as
`jaxcorr.train.setup.build_prompts` shares the default set).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxcorr.config import convert, fields
from jaxcorr.data import prompt_check
from jaxcorr.data import prompts as data
from jaxcorr.data.config import DataConfig
from jaxcorr.data.tasks import Example

# Data fields a set may not change: the rollout stage renders every set's
# prompts with the run's template, and eval prompts are never shuffled.
_FIXED = ('prompt_template', 'shuffle')
PROMPTS = 'prompts'


@dataclasses.dataclass(frozen=True)
class EvalSet:
  """A named eval set; `name` '' logs under `eval/`, others under
  `eval/<name>/`. `examples`: this process's share of its prompts."""

  name: str
  examples: list[Example]

  @property
  def prefix(self) -> str:
    return f'eval/{self.name}/' if self.name else 'eval/'


def _allowed() -> tuple[str, ...]:
  names = [n for n in convert.names(DataConfig) if n not in _FIXED]
  return (*names, PROMPTS)


def _data_of(run: Any, name: str, overrides: dict) -> tuple[DataConfig, int]:
  """(the set's DataConfig, its prompt count), errors under
  `config.eval.sets.<name>`."""
  path = f'config.eval.sets.{name}'
  convert.check_keys(path, overrides, _allowed())
  changes = {k: v for k, v in overrides.items() if k != PROMPTS}
  count = overrides.get(PROMPTS, run.train.eval_prompts)
  if isinstance(count, bool) or not isinstance(count, int) or count < 1:
    fields.fail(f'{path}.{PROMPTS}', count, 'an integer >= 1')
  base = {
    f.name: getattr(run.data, f.name) for f in dataclasses.fields(run.data)
  }
  cfg = convert.build(DataConfig, path, {**base, **changes})
  return cfg, count


def check(run: Any) -> None:
  """Start-up check of `eval.sets`: known data fields, valid values, and a
  held-out source for each set (no file is read)."""
  for name, overrides in run.eval.named_sets.items():
    cfg, _ = _data_of(run, name, overrides)
    if cfg.source in ('jsonl', 'parquet') and not cfg.eval_path:
      fields.fail(
        f'config.eval.sets.{name}.eval_path',
        cfg.eval_path,
        f'a held-out {cfg.source} file (the set has no other prompts)',
      )


def _share(source: Sequence[Example], count: int) -> list[Example]:
  index, processes = jax.process_index(), jax.process_count()
  n = min(count, len(source))
  share = (n - n % processes) // processes
  lo = index * share
  return [source[i] for i in range(lo, lo + share)]


def build_sets(
  run: Any,
  default: Sequence[Example],
  encode: Callable[[str], Sequence[int]],
) -> list[EvalSet]:
  """The run's eval sets: `default` (the data section's held-out share) as
  the one unnamed set when `eval.sets` is '', else the named sets, each
  prompt tokenized and length-checked now."""
  named = run.eval.named_sets
  if not named:
    return [EvalSet('', list(default))]
  out = []
  for name, overrides in named.items():
    cfg, count = _data_of(run, name, overrides)
    source = data.make_eval_source(cfg)
    if source is None:
      fields.fail(
        f'config.eval.sets.{name}',
        overrides,
        'overrides that give the set held-out prompts (eval_examples > 0, '
        'or an eval_path)',
      )
    examples = _share(source, count)
    prompt_check.check_prompts(
      examples,
      encode,
      template=run.data.prompt_template,
      max_prompt_length=run.rollout.max_prompt_length,
    )
    out.append(EvalSet(name, examples))
  return out
