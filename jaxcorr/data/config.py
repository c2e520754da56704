"""The trainer's `data` section: where the prompts come from and how they
are written (docs/data_and_rewards.md).

One frozen dataclass of `setting`s; `jaxcorr.data.prompts` reads it
(`make_source`, `make_eval_source`). Whether `prompt_template` formats is
checked once at start-up by `jaxcorr.train.build` (it runs
`jaxcorr.data.prompts.format_prompt`), not here.
"""

from __future__ import annotations

import dataclasses

from jaxcorr.config.fields import (
  boolean,
  fail,
  integer,
  one_of,
  setting,
  text,
  validate,
)

SOURCES = ('arithmetic', 'jsonl', 'parquet', 'reasoning_gym', 'code')
ANSWER_FORMATS = ('gsm8k', 'raw')
TOKENIZERS = ('chars', 'bytes')
_POS, _NAT = integer(1), integer(0)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Prompts: the embedded arithmetic task, a local JSONL/Parquet file or
  a reasoning-gym task (`jaxcorr.data.reasoning_gym`)."""

  source: str = setting(
    'arithmetic',
    one_of(*SOURCES),
    "'arithmetic' (generated, no files), 'jsonl', 'parquet' or "
    "'reasoning_gym' (generated; pip install jaxcorr[reasoning_gym]) or "
    "'code' (generated functions with hidden tests: reward code_tests).",
  )
  path: str = setting('', text, 'jsonl/parquet: the training file.')
  eval_path: str = setting(
    '',
    text,
    "jsonl/parquet: a held-out file for evaluation ('' takes eval prompts "
    'from the end of a generated task, or none for files).',
  )
  prompt_field: str = setting(
    'question', text, 'jsonl/parquet: the prompt field (GSM8K: question).'
  )
  answer_field: str = setting(
    'answer', text, 'jsonl/parquet: the answer field (GSM8K: answer).'
  )
  answer_format: str = setting(
    'gsm8k',
    one_of(*ANSWER_FORMATS),
    "'gsm8k' (the answer after '####') or 'raw'.",
  )
  prompt_template: str = setting(
    '{prompt}', text, "Text around the prompt; must contain '{prompt}'."
  )
  tokenizer: str = setting(
    'chars',
    one_of(*TOKENIZERS),
    "The vocabulary of a model from scratch (model.hf_path=''): 'chars' "
    '(27 ids, arithmetic text only: jaxcorr.data.tasks.CharTokenizer) or '
    "'bytes' (259 ids, any UTF-8 text: jaxcorr.data.text.ByteTokenizer; "
    'model.vocab_size >= 259). A HF checkpoint uses its tokenizer.json.',
  )
  shuffle: bool = setting(
    True,
    boolean,
    'Shuffle every epoch (deterministic from train.seed and the epoch).',
  )
  num_examples: int = setting(
    100_000, _POS, 'arithmetic, reasoning_gym, code: training examples.'
  )
  seed: int = setting(
    0, _NAT, 'arithmetic, reasoning_gym, code: seed of the training examples.'
  )
  max_operand: int = setting(99, _POS, 'arithmetic: largest operand.')
  ops: str = setting(
    '+', text, "arithmetic: the operators, a non-empty string of '+-*'."
  )
  eval_examples: int = setting(
    256,
    _NAT,
    'arithmetic: held-out evaluation examples (seed + 1); reasoning_gym, '
    'code: the same, drawn with seed + num_examples.',
  )
  task: str = setting(
    '',
    text,
    "reasoning_gym: a task name ('chain_sum') or a weighted mix "
    "('chain_sum:2,leg_counting:1').",
  )
  task_config: str = setting(
    '',
    text,
    "reasoning_gym: JSON of the generator's config fields (one task: "
    '{"max_terms": 3}; a mix: keyed by task name); \'\' for defaults.',
  )

  def __post_init__(self):
    p = validate(self)
    if self.source in ('jsonl', 'parquet') and not self.path:
      fail(f'{p}.path', self.path, f'a local {self.source} file')
    if self.source == 'reasoning_gym' and not self.task.strip():
      fail(f'{p}.task', self.task, "a reasoning-gym task name, or 'name:w,...'")
    if not self.ops or set(self.ops) - set('+-*'):
      fail(f'{p}.ops', self.ops, "a non-empty string of '+', '-', '*'")
