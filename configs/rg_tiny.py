"""A reasoning-gym task on the embedded tiny model, no downloads:
`chain_sum` (two 1-digit terms, + and -) scored by the task's own
`score_answer`.

  pip install "jaxcorr[reasoning_gym]"
  python -m jaxcorr.main --config=configs/rg_tiny.py --workdir=/tmp/rg
  python -m jaxcorr.main --config=configs/rg_tiny.py:pulse ...

The model is configs/arith_tiny.py's, over the byte vocabulary
(`data.tokenizer='bytes'`, `jaxcorr.data.text.ByteTokenizer`): the
questions ('State the final answer to the following arithmetic problem:
4 - 1 =', 67 bytes) have letters the 27-id character vocabulary cannot
encode. The reward reads the reply's last `<answer>...</answer>`, and a
reasoning-gym source has no SFT warm-up (its answers are reference keys,
jaxcorr/data/reasoning_gym.py), so a model from scratch scores 0 until
it writes the tags by chance: this config shows the reasoning-gym path
(sources, the task's scorer, pass@k evaluation) running end to end on a
laptop, not a model that learns the task. configs/smollm2_rg.py is the
one that learns it (docs/evaluation.md, section 4).

The config string is `[pulse+]<preset>` as in configs/arith_tiny.py.
"""

from __future__ import annotations

import json

import ml_collections

from configs import arith_tiny
from jaxcorr.data.text import ByteTokenizer

TASK_CONFIG = {'min_terms': 2, 'max_terms': 2, 'min_digits': 1, 'max_digits': 1}


def apply_task(config: ml_collections.ConfigDict) -> None:
  """configs/arith_tiny.py's model and RL settings on chain_sum."""
  arith_tiny.apply_task(config)
  config.model.vocab_size = ByteTokenizer.vocab_size
  config.model.max_position_embeddings = 96
  config.data.tokenizer = 'bytes'
  config.data.source = 'reasoning_gym'
  config.data.task = 'chain_sum'
  config.data.task_config = json.dumps(TASK_CONFIG)
  config.data.eval_examples = 64
  config.rollout.max_prompt_length = 72  # BOS + the 67-byte question
  config.rollout.max_new_tokens = 24  # '<answer>-18</answer>' and EOS
  config.reward.functions = 'reasoning_gym'
  config.train.sft_steps = 0  # refused with reasoning_gym (module doc)
  config.train.eval_prompts = 64


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  return arith_tiny.task_config(config_string, apply_task, sft_steps=0)
