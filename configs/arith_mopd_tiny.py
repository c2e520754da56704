"""Multi-teacher on-policy distillation (MOPD) on a two-task arithmetic
mix: addition and multiplication prompts (data.ops '+*', tasks add and
mul), each row scored by its own task's teacher (docs/distillation.md).

  python -m jaxcorr.main --config=configs/arith_tiny.py \\
    --config.data.ops=+ --workdir=/tmp/teacher_add
  python -m jaxcorr.main --config=configs/arith_tiny.py \\
    --config.data.ops='*' --workdir=/tmp/teacher_mul
  python -m jaxcorr.main --config=configs/arith_mopd_tiny.py \\
    --workdir=/tmp/student

The teachers are named after the tasks they score, so `distill.routes`
stays '' (each task to the teacher of its name); another layout, e.g. one
teacher for two tasks, is `--config.distill.routes=add:a,sub:a,mul:m`.
The config string is configs/arith_opd_tiny.py's (`[pulse+]<opd
preset>[+<correction preset>]`).
"""

from __future__ import annotations

import ml_collections

from configs import arith_opd_tiny

TEACHERS = 'add=/tmp/teacher_add,mul=/tmp/teacher_mul'


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  config = arith_opd_tiny.get_config(config_string)
  config.data.ops = '+*'
  config.distill.teachers = TEACHERS
  return config
