"""`config.distill`: on-policy distillation from a teacher (docs/distillation.md).

Off by default (`teacher=''`). With a teacher, `prepare`
scores every sampled response token under it and `loss` decides what the
update trains on; the student's sampling, correction and async modes are
unchanged.
"""

from __future__ import annotations

import dataclasses

from jaxcorr.config.fields import (
  boolean,
  number,
  one_of,
  setting,
  text,
  validate,
)

LOSSES = ('reverse_kl_advantage',)
"""What the trainer runs today: the per-token reverse KL as a dense
advantage (trained through `config.actor`'s policy loss). The direct
losses of jaxcorr/losses/distill.py (reverse_kl_loss, topk_kl,
generalized_jsd) are library functions; docs/distillation.md says what
wiring them into the update needs."""


@dataclasses.dataclass(frozen=True)
class DistillConfig:
  """A teacher (or one per data source) and how its log-probs train."""

  teacher: str = setting(
    '',
    text,
    'The teacher: a Hugging Face directory, a jaxcorr workdir (its latest '
    "checkpoint, or 'workdir@STEP'); a GGUF file is converted first "
    "(python -m jaxcorr.convert). '': no distillation.",
  )
  logp_source: str = setting(
    'trainer',
    one_of('trainer', 'engine'),
    "Where the teacher's log-probs come from: 'trainer' (a forward pass "
    "sharded like the policy, no gradient, in teacher_dtype) or 'engine' "
    '(the engine-held teacher scoring the sampled ids, prefill only, in '
    'rollout.engine_dtype; the trainer-side pass also runs and '
    'teacher_corr/ reports the gap).',
  )
  correct_teacher: bool = setting(
    True,
    boolean,
    "With logp_source='engine': train on the trainer-side teacher "
    'log-probs (the correction: the gap is measured, then removed); False '
    "trains on the engine's, as slime's sglang teacher does.",
  )
  loss: str = setting(
    'reverse_kl_advantage', one_of(*LOSSES), 'What the teacher trains.'
  )
  estimator: str = setting(
    'k1',
    one_of('k1', 'k3'),
    'Per-token reverse KL estimator: k1 (s - t) or k3 (low_var_kl).',
  )
  coef: float = setting(
    1.0,
    number(0, lo_open=True),
    'Weight of the reverse KL in the advantage (slime opd_kl_coef).',
  )
  task_reward: bool = setting(
    False,
    boolean,
    'Keep the task advantage (RL + distillation: A - coef*KL); False '
    'trains on the distillation signal alone.',
  )
  teacher_dtype: str = setting(
    'float32',
    one_of('float32', 'bfloat16'),
    "The teacher's parameter and compute dtype on the trainer.",
  )

  def __post_init__(self):
    validate(self)

  @property
  def enabled(self) -> bool:
    return bool(self.teacher)
