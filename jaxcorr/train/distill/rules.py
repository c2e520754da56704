"""Config-time rules of the direct distillation losses (docs/distillation.md,
"Direct losses in the update"): which runs carry a direct term and which
settings it refuses. Apart from jaxcorr/train/distill/direct.py, whose
arrays need the engine's modules (JetStream, hence TensorFlow), so that
building a config imports neither."""

from __future__ import annotations

from typing import Any

from jaxcorr.config.fields import fail
from jaxcorr.train.distill.config import TOPK_LOSSES

ADVANTAGE = 'reverse_kl_advantage'


def is_direct(run: Any) -> bool:
  """A teacher and a direct loss term in the update."""
  return run.distill.enabled and run.distill.loss != ADVANTAGE


def needs_topk(run: Any) -> bool:
  """A teacher and a loss on its top-k support ('topk_kl', 'gjsd')."""
  return run.distill.enabled and run.distill.loss in TOPK_LOSSES


def check(run: Any) -> None:
  """Config-time rules of the direct losses (one line naming the field):
  decoupled correction (bypass divides the summed loss by its corrected
  count at the end, which would rescale the term), and for the top-k
  losses the unpacked dense full-log-prob forward they read."""
  if not is_direct(run):
    return
  loss = run.distill.loss
  if not run.decoupled:
    fail(
      'config.distill.loss', loss,
      f"{ADVANTAGE!r} with correction.mode='bypass'",
      'the bypass loss is divided by its corrected token count at the end, '
      'which would rescale the term; use correction.mode=decoupled',
    )  # fmt: skip
  if not needs_topk(run):
    return
  why = "the student's top-k log-probs come from the unpacked full softmax"
  if run.train.packing:
    fail('config.train.packing', True, f'False with distill.loss={loss!r}', why)
  if run.rollout.logprob_mode != 'full':
    fail(
      'config.rollout.logprob_mode', run.rollout.logprob_mode,
      f"'full' with distill.loss={loss!r}", why,
    )  # fmt: skip
  if run.model.num_experts:
    fail(
      'config.distill.loss', loss,
      "'reverse_kl_advantage' or 'reverse_kl' with an MoE policy",
      "the top-k forward is the dense policy's",
    )  # fmt: skip
