"""The embedded default: a tiny model learns 2-digit addition from scratch.

No downloads. A 2-layer, 0.4M-parameter transformer over a 27-id character
vocabulary is warmed up with supervised cross-entropy on `a+b=` -> `c`
(`train.sft_steps`), then trained with GRPO (8 samples per prompt,
exact-match reward) and the chosen correction preset. On a 2-core CPU the
whole run takes a few minutes; greedy accuracy on held-out problems
(`eval/accuracy` in metrics.jsonl) rises during RL (docs/training.md has
the measured curve).

  python -m jaxcorr.main --config=configs/arith_tiny.py --workdir=/tmp/arith
  python -m jaxcorr.main --config=configs/arith_tiny.py:bypass_pg_is ...
  python -m jaxcorr.main --config=configs/arith_tiny.py:pulse ...

The config string is `[pulse+]<preset>`: `pulse` shrinks the run to a few
steps (tests and smoke runs); the rest is any correction preset of
`configs/presets.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_collections

from configs import base
from jaxcorr.data.tasks import CharTokenizer


def apply_task(config: ml_collections.ConfigDict) -> None:
  """The arithmetic task's values (no new keys)."""
  config.model.vocab_size = CharTokenizer().vocab_size
  config.model.hidden_size = 128
  config.model.intermediate_size = 384
  config.model.num_layers = 2
  config.model.num_heads = 4
  config.model.num_kv_heads = 2
  config.model.max_position_embeddings = 32
  config.model.initializer_range = 0.05
  config.data.source = 'arithmetic'
  config.data.max_operand = 99
  config.data.ops = '+'
  config.data.eval_examples = 256
  config.rollout.prompts_per_step = 32
  config.rollout.samples_per_prompt = 8
  config.rollout.max_prompt_length = 8
  config.rollout.max_new_tokens = 5
  config.rollout.max_concurrent_decodes = 256
  config.reward.functions = 'exact_match'
  config.train.sft_steps = 300
  config.train.sft_batch_size = 128
  config.train.num_steps = 200
  config.train.eval_every = 20
  config.train.eval_prompts = 256
  config.train.checkpoint_every = 50
  config.optim.sft_learning_rate = 3e-3
  config.optim.learning_rate = 1.5e-4
  # A warmup and a cosine decay for both phases: with a constant 3e-3 the
  # warm-up ended anywhere between 0.16 and 0.48 accuracy depending on the
  # machine's float rounding (docs/training.md).
  config.optim.schedule = 'cosine'
  config.optim.warmup_steps = 20
  config.algorithm.estimator = 'grpo'
  config.mesh.data = 1
  config.mesh.fsdp = -1


def apply_pulse(config: ml_collections.ConfigDict) -> None:
  """A few seconds' run: checks that every stage runs, not that it learns."""
  config.model.hidden_size = 32
  config.model.intermediate_size = 64
  config.model.num_heads = 2
  config.model.num_kv_heads = 1
  config.rollout.prompts_per_step = 4
  config.rollout.samples_per_prompt = 4
  config.rollout.max_concurrent_decodes = 16
  config.train.sft_steps = 2
  config.train.sft_batch_size = 16
  config.train.num_steps = 3
  config.train.eval_every = 3
  config.train.eval_prompts = 8
  config.train.checkpoint_every = 2
  config.optim.schedule = 'constant'
  config.optim.warmup_steps = 0


def split(config_string: str | None) -> tuple[bool, str | None]:
  """'pulse+decoupled_token_is' -> (True, 'decoupled_token_is')."""
  s = config_string or ''
  if s == 'pulse' or s.startswith('pulse+'):
    return True, s[len('pulse+') :] or None
  return False, s or None


def task_config(
  config_string: str | None,
  apply: Callable[[ml_collections.ConfigDict], None],
  **pulse_train: Any,
) -> ml_collections.ConfigDict:
  """A tiny task's config: the base config with `apply` (the task), then,
  for `pulse+...`, the pulse sizes and `pulse_train` (train fields the
  pulse must set otherwise, e.g. sft_steps=0 for a task without
  demonstrations)."""
  pulse, preset = split(config_string)

  def task(config: ml_collections.ConfigDict) -> None:
    apply(config)
    if pulse:
      apply_pulse(config)
      config.train.update(pulse_train)

  return base.get_config(preset, task=task)


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  return task_config(config_string, apply_task)
