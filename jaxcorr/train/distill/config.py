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
  fail,
  integer,
  number,
  one_of,
  optional,
  setting,
  text,
  validate,
)
from jaxcorr.train.distill import routes as routing

LOSSES = ('reverse_kl_advantage', 'reverse_kl', 'topk_kl', 'gjsd')
"""'reverse_kl_advantage': the per-token reverse KL as a dense advantage,
trained through `config.actor`'s policy loss. The others are direct loss
terms in the update on the current student (jaxcorr/train/distill/
direct.py): `losses.distill.reverse_kl_loss`, `topk_kl`, `generalized_jsd`."""
TOPK_LOSSES = ('topk_kl', 'gjsd')
"""The losses that read the teacher's top-k ids and log-probs."""


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
  teachers: str = setting(
    '',
    text,
    "Several teachers (MOPD): 'name=path,name=path', paths as for "
    "`teacher` (exclusive with it); each row is scored by its task's "
    'teacher (`routes`) and reported under distill/<name>/.',
  )
  routes: str = setting(
    '',
    text,
    "With `teachers`: 'task:name,task:name', each task of config.data "
    '(arithmetic: add, sub, mul; a reasoning-gym task name; else '
    "data.source) to a teacher; '' routes a task to the teacher of its name.",
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
    'reverse_kl_advantage',
    one_of(*LOSSES),
    "What the teacher trains: 'reverse_kl_advantage' (a dense advantage "
    'through the policy loss), or a direct loss term on the current '
    "student: 'reverse_kl' (estimator k1/k3), 'topk_kl' (KL on the "
    "teacher's top-k support), 'gjsd' (TRL GKD's generalised JSD).",
  )
  topk: int = setting(
    16,
    integer(1),
    "'topk_kl' and 'gjsd': the teacher's top-k token ids kept per "
    'position (prepare carries [B, T, k] ids and log-probs; capped at the '
    'vocabulary; verl distillation.topk).',
  )
  topk_direction: str = setting(
    'forward',
    one_of('forward', 'reverse'),
    "'topk_kl': KL(teacher || student) (verl forward_kl_topk) or "
    'KL(student || teacher) (reverse_kl_topk) on the support.',
  )
  beta: float = setting(
    0.5,
    number(0, 1),
    "'gjsd': TRL's beta: 0 the forward KL(t || s), 1 the reverse KL(s || t).",
  )
  lmbda: float = setting(
    1.0,
    number(0, 1),
    "'gjsd': TRL's on-policy (student-sample) fraction; only 1.0 runs "
    '(docs/distillation.md, "GKD\'s lambda").',
  )
  loss_clamp: float | None = setting(
    None,
    optional(number(0, lo_open=True), 'no clamp'),
    "Direct losses 'reverse_kl', 'topk_kl': clamp each token's KL from "
    'above (verl distillation.loss_clamp).',
  )
  estimator: str = setting(
    'k1',
    one_of('k1', 'k3'),
    'Per-token reverse KL estimator: k1 (s - t) or k3 (low_var_kl).',
  )
  coef: float = setting(
    1.0,
    number(0, lo_open=True),
    'Weight of the reverse KL in the advantage (slime opd_kl_coef), or of '
    'the direct loss term in the update.',
  )
  task_reward: bool = setting(
    False,
    boolean,
    'Keep the task advantage (RL + distillation: A - coef*KL, or with a '
    'direct loss the policy loss on A plus coef x the term); False '
    'trains on the distillation signal alone.',
  )
  teacher_dtype: str = setting(
    'float32',
    one_of('float32', 'bfloat16'),
    "The teacher's parameter and compute dtype on the trainer.",
  )

  def __post_init__(self):
    path = validate(self)
    if self.lmbda != 1.0:
      fail(
        f'{path}.lmbda', self.lmbda, '1.0',
        'the RL batches are the student\'s samples only; the off-policy '
        'share would train on dataset answers, which they do not carry',
      )  # fmt: skip
    raw = self.logp_source == 'engine' and not self.correct_teacher
    if self.loss in TOPK_LOSSES and raw:
      fail(
        f'{path}.loss', self.loss,
        "'reverse_kl_advantage' or 'reverse_kl' with logp_source='engine' "
        'and correct_teacher=False',
        "the engine pass scores the sampled ids only, not the teacher's top-k",
      )  # fmt: skip

    self._check_teachers(path)

  def _check_teachers(self, path: str) -> None:
    if self.teacher and self.teachers:
      fail(f'{path}.teachers', self.teachers, "'' when distill.teacher is set")
    if self.routes and not self.teachers:
      fail(f'{path}.routes', self.routes, "'' without distill.teachers")
    routing.parse_routes(self.routes, [n for n, _ in self.members])
    if self.teachers and self.loss in TOPK_LOSSES:
      fail(
        f'{path}.loss', self.loss,
        "'reverse_kl_advantage' or 'reverse_kl' with distill.teachers",
        "the top-k support is one teacher's; MOPD routes sampled-token log-probs",
      )  # fmt: skip

  @property
  def enabled(self) -> bool:
    return bool(self.teacher or self.teachers)

  @property
  def members(self) -> tuple[tuple[str, str], ...]:
    """((name, path), ...) of the teachers; `teacher` is named 'teacher'."""
    if self.teachers:
      return routing.parse_teachers(self.teachers)
    return (('teacher', self.teacher),) if self.teacher else ()
