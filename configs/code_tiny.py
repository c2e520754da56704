"""The sandboxed code task on the embedded tiny model, no downloads:
generated 'write a function f(x) that returns ...' prompts
(`data.source='code'`, jaxcorr/data/code_tasks.py) scored by `code_tests`,
which runs the reply's code against the hidden tests in the sandbox
(jaxcorr/sandbox/, docs/data_and_rewards.md "Sandboxed code").

  python -m jaxcorr.main --config=configs/code_tiny.py:pulse --workdir=/tmp/c

A model from scratch over bytes writes no code: nearly every reply scores
0 as 'no_code' (reward/code_tests/outcome/no_code). The config shows the
path (source, sandboxed reward, its outcome metrics) running end to end;
configs/smollm2_code.py is the one whose replies are code.

The config string is `[pulse+]<preset>` as in configs/arith_tiny.py.
"""

from __future__ import annotations

import ml_collections

from configs import arith_tiny
from jaxcorr.data.text import ByteTokenizer


def apply_sandbox_reward(config: ml_collections.ConfigDict) -> None:
  """The reward and its time limit: `code_tests` runs 3 s at most in its
  sandbox, plus about 0.1 s of start-up, under the scorer's per-call
  limit (jaxcorr/rewards/code.py)."""
  config.data.source = 'code'
  config.reward.functions = 'code_tests'
  config.reward.timeout_s = 10.0
  config.train.sft_steps = 0  # the answers are tests, not replies


def apply_task(config: ml_collections.ConfigDict) -> None:
  """configs/arith_tiny.py's model and RL settings on the code task."""
  arith_tiny.apply_task(config)
  apply_sandbox_reward(config)
  config.model.vocab_size = ByteTokenizer.vocab_size
  config.model.max_position_embeddings = 256
  config.data.tokenizer = 'bytes'
  config.data.eval_examples = 64
  config.rollout.max_prompt_length = 160  # the longest prompt: 149 bytes
  config.rollout.max_new_tokens = 64
  config.train.eval_prompts = 64


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  return arith_tiny.task_config(config_string, apply_task, sft_steps=0)
