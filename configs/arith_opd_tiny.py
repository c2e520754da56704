"""On-policy distillation on the arithmetic task (configs/arith_tiny.py):
the student samples, a teacher scores every sampled token, and the reverse
KL is the dense reward (docs/distillation.md).

  python -m jaxcorr.main --config=configs/arith_tiny.py --workdir=/tmp/teacher
  python -m jaxcorr.main --config=configs/arith_opd_tiny.py \\
    --config.distill.teacher=/tmp/teacher --workdir=/tmp/student

The config string is `[pulse+]<opd preset>[+<correction preset>]`
(configs/opd.py). The teacher is any arith_tiny-shaped workdir (its latest
checkpoint, or `workdir@STEP`): same character tokenizer and vocabulary.
The student starts from scratch with no SFT warm-up: what it learns comes
from the teacher alone (exact match still scores the evaluation).
"""

from __future__ import annotations

import ml_collections

from configs import arith_tiny, base, opd


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  pulse, preset, correction = opd.split(config_string)

  def task(config: ml_collections.ConfigDict) -> None:
    arith_tiny.apply_task(config)
    if pulse:
      arith_tiny.apply_pulse(config)
    config.train.sft_steps = 0
    config.optim.learning_rate = 1e-3
    opd.apply(config, preset)

  return base.get_config(correction, task=task)
