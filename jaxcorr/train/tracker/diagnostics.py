"""`train.metrics_every`: the heavy diagnostics on every N-th step only.

The rollout correction's `rollout_corr/` statistics and the policy loss's
`actor/` diagnostics (clip fractions, ratio statistics, ...) cost more than
the loss itself (docs/benchmarks.md, "Losses": 7.7x the memory floor with
them, 3x without). On a light step the compiled prepare and update return
only the `KEPT` metrics; XLA then drops every computation that fed only
the others, and the loss, the gradients and the update are those of a full
step (tested). Steps 1, N + 1, 2N + 1, ... are full, so the first step and
one step in N log everything.

`actor/entropy` is kept on light steps only when the loss uses the entropy
(`actor.entropy_coeff` != 0): otherwise a light update does not compute it
at all (`jaxcorr.train.step.needs_entropy`), as verl computes it only when
asked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The `actor/` metrics every step keeps: the loss terms, counts and the
# optimizer's (the rest of `actor/` and all of `rollout_corr/` are heavy).
KEPT_ACTOR = frozenset(
  {
    'actor/loss',
    'actor/pg_loss',
    'actor/entropy',
    'actor/kl_loss',
    'actor/rollout_kl_loss',
    'actor/loss_token_count',
    'actor/loss_seq_count',
    'actor/grad_norm',
    'actor/lr',
    'actor/updates',
  }
)


def is_heavy(key: str) -> bool:
  return key.startswith('rollout_corr/') or (
    key.startswith('actor/') and key not in KEPT_ACTOR
  )


def light(metrics: Mapping[str, Any]) -> dict[str, Any]:
  """`metrics` without the heavy diagnostics."""
  return {k: v for k, v in metrics.items() if not is_heavy(k)}


def full_step(step: int, every: int) -> bool:
  """Step `step` (0-based, as `RLStep` counts) logs every metric."""
  return step % every == 0
