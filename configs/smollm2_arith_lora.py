"""The SmolLM2 arithmetic task (configs/smollm2_arith.py) with LoRA:
rank-16 adapters on every attention and MLP projection, the base frozen.

  python -m jaxcorr.main --config=configs/smollm2_arith_lora.py \\
    --workdir=workdir/smollm2_arith_lora
  python -m jaxcorr.export --workdir=workdir/smollm2_arith_lora \\
    --out=/tmp/smollm2_lora --adapter          # a PEFT directory

Same task, batch, sampling and schedule as the full fine-tuning config;
only the trained parameters and the learning rate change. LoRA wants a
learning rate about 10x that of full fine-tuning (the update is the
low-rank product alpha / r · A B, with B starting at zero; PEFT's and
verl's LoRA recipes use 1e-5 .. 1e-4 where full fine-tuning uses
1e-6 .. 1e-5): 2e-4 here against 2e-5. alpha = 2r keeps the scale at 2.
The engine decodes with the adapters merged into its bfloat16 copy
(`lora.engine_merged`, docs/lora.md) and checks every sync's delivery.
The config string is the one of configs/smollm2_arith.py
(`[pulse+]<preset>`).
"""

from __future__ import annotations

import ml_collections

from configs import smollm2_arith
from jaxcorr.model.lora import TARGETS

RANK = 16
LEARNING_RATE = 2e-4


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  config = smollm2_arith.get_config(config_string)
  config.lora.rank = RANK
  config.lora.alpha = float(2 * RANK)
  config.lora.target_modules = ','.join(TARGETS)
  config.optim.learning_rate = LEARNING_RATE
  return config
