"""The suite's named tolerances and its one closeness assertion.

A comparison says what it compares by the tolerance it picks; the numbers
live here once. The golden ones are the spec's (docs/conformance.md,
"Tolerances"): float32 values, sums, means and gradients to 1e-6; metrics
that subtract two means (std, variance, χ²) to 1e-5 relative; sums of many
terms that nearly cancel scale atol by the sum of the absolute terms.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Tol:
  rtol: float
  atol: float


TOL_GOLDEN = Tol(rtol=1e-6, atol=1e-6)
"""A value, mean or gradient replayed from a reference framework's float32
call (the spec's bar)."""

TOL_GOLDEN_SPREAD = Tol(rtol=1e-5, atol=1e-5)
"""A std / variance / χ²-type correction metric of a golden case: the
references' one-pass float32 formulas are off by 3-4e-6 relative."""

TOL_GOLDEN_METRICS = Tol(rtol=1e-5, atol=1e-6)
"""The metrics of a golden actor-objective call, std / χ²-type ones among
them."""

TOL_GOLDEN_FROM_LOGITS = Tol(rtol=2e-6, atol=1e-6)
"""A statistic a reference computes from the logits in float32 (slime's
entropy: a log-softmax, then a sum over the vocabulary)."""

TOL_GOLDEN_EXP = Tol(rtol=2e-6, atol=1e-6)
"""A reference's exponential of a float32 log-ratio (an IS weight): exp
turns the log-ratio's absolute rounding into relative error."""

TOL_REORDERED = Tol(rtol=1e-6, atol=1e-7)
"""The same float32 loss with its sums in another order: micro-batches with
global counts against the full batch, jit against eager, sharded against
one device."""

TOL_REORDERED_GRAD = Tol(rtol=1e-6, atol=1e-8)
"""The gradient of such a reordered loss where the order is the compiler's
alone (jit, sharding)."""

TOL_REORDERED_METRICS = Tol(rtol=1e-5, atol=1e-6)
"""The metrics of such a reordered call, std / χ²-type ones among them."""

TOL_EQUIVALENT = Tol(rtol=1e-6, atol=0.0)
"""Agreement to float32 relative rounding with no absolute slack: two routes
to one expression (a bypass loss and its decoupled twin when old = rollout;
jit against eager), or a golden value held to that (a clip fraction, a loss
far from 0)."""

TOL_EQUIVALENT_GRAD = Tol(rtol=1e-6, atol=1e-9)
"""The gradients of two such routes (zeros need a hair of absolute slack)."""

TOL_LAYOUT = Tol(rtol=2e-5, atol=2e-6)
"""Updated parameters of one trainer step under two batch layouts (padding
rows, micro-batches, sharding): float32 sums in another order, amplified by
Adam's m / sqrt(v) on near-zero gradients."""

TOL_LAYOUT_METRICS = Tol(rtol=1e-4, atol=1e-5)
"""The step metrics of the same two layouts: means of per-row statistics
reduced in another order."""

TOL_LAYOUT_SHARDED = Tol(rtol=1e-4, atol=1e-5)
"""Updated parameters of one trainer step sharded over 8 devices against
one device: the collectives sum the gradients in an order of their own."""


def assert_close(
  got,
  want,
  tol: Tol = TOL_GOLDEN,
  *,
  mask=None,
  scale: float | None = None,
  what: str = '',
) -> None:
  """`got ≈ want` within `tol`, compared in float64.

  Args:
    mask: compare only these positions (boolean, the arrays' shape).
    scale: the sum of the absolute terms behind a value that is a sum of
      many nearly cancelling terms; atol grows to `tol.atol * max(1, scale)`.
    what: named in the failure message.
  """
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  if mask is not None:
    got, want = got[mask], want[mask]
  atol = tol.atol if scale is None else tol.atol * max(1.0, float(scale))
  np.testing.assert_allclose(got, want, rtol=tol.rtol, atol=atol, err_msg=what)
