"""On-policy distillation on SmolLM2-135M (docs/distillation.md): the
student samples, an RL-trained SmolLM2 teacher scores every sampled token.

  python -m jaxcorr.main --config=configs/smollm2_arith.py --workdir=wd/teacher
  python -m jaxcorr.main --config=configs/smollm2_opd.py \\
    --config.distill.teacher=wd/teacher --workdir=wd/opd

The config string is `[pulse+]<opd preset>[+<correction preset>]`
(configs/opd.py): `opd_k1` (default), `opd_k3`, `opd_rl` (task reward plus
the KL term, slime's --use-opd), `opd_engine` / `opd_engine_raw` (the
teacher as the bfloat16 engine holds it: teacher_corr/ reports its gap;
trained on the trainer-side log-probs, or on the engine's). The teacher is
a workdir of configs/smollm2_arith.py (or any directory `load_hf` reads
with SmolLM2's tokenizer); '' until set on the command line.
"""

from __future__ import annotations

import ml_collections

from configs import base, opd, smollm2_arith


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  pulse, preset, correction = opd.split(config_string)

  def task(config: ml_collections.ConfigDict) -> None:
    smollm2_arith.apply_task(config)
    if pulse:
      smollm2_arith.apply_pulse(config)
    # GRPO's 2e-5: every token carries a reward, and at 5e-5 both seeds
    # diverged after ~3 steps (docs/distillation.md, "SmolLM2:
    # distillation against GRPO").
    config.optim.learning_rate = 2e-5
    opd.apply(config, preset)

  return base.get_config(correction, task=task)
