"""The parity statistics of engine log-probs μ against the trainer's π_old.

With d_t = log π_old(y_t) − log μ(y_t) on the response tokens (mask m):

    token_<b>      fraction of tokens with |exp(d_t) − 1| ≤ b
    seq_<b>        fraction of sequences with |exp(mean_t d_t) − 1| ≤ b
                   (the geometric-mean ratio of the row's tokens)
    max_abs_dlogp  max_t |d_t|
    k3             mean_t exp(r̂_t) − 1 − r̂_t, r̂ = clip(d, ±20): the
                   correction's own k3 (`rejection.STATISTICS['k3']`,
                   `rollout_corr/k3_kl`)
    bitwise        fraction of tokens whose two float32 values have the
                   same bits (−0.0 and 0.0 differ; NaN equals its own bits)
    argmax         fraction of positions where argmax π_old == argmax μ
                   (given separately: another batch, `parity.measure`)

for the bands b of `BANDS`: MaxText PR #5231's ±0.1% (its strict band
is [0.999, 1.002]), ±1% and ±5%. Pure numpy in, floats out.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxcorr.losses.correction.rejection import STATISTICS, Sample

BANDS = (('0.1%', 1e-3), ('1%', 1e-2), ('5%', 5e-2))
"""(label, b): the retention bands |ratio − 1| ≤ b."""


def _bits_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  a32 = np.ascontiguousarray(a, np.float32).view(np.uint32)
  return a32 == np.ascontiguousarray(b, np.float32).view(np.uint32)


def _k3(d: np.ndarray, pi: np.ndarray, mu: np.ndarray, m: np.ndarray):
  sample = Sample(r=d, train=pi, rollout=mu, m=m)
  return np.asarray(STATISTICS['k3'].token(sample), np.float64)


def parity_bands(
  pi: np.ndarray,
  mu: np.ndarray,
  mask: np.ndarray,
  *,
  argmax_pi: np.ndarray | None = None,
  argmax_mu: np.ndarray | None = None,
  argmax_mask: np.ndarray | None = None,
) -> dict[str, float]:
  """The module docstring's statistics of `pi`, `mu` `[B, T]` float32 on
  `mask` `[B, T]` bool, and, when given, the argmax agreement of the
  `[B', T']` ids on `argmax_mask`. Rows without a masked token count in
  no sequence band; an empty mask gives NaN fractions."""
  pi = np.asarray(pi, np.float32)
  mu = np.asarray(mu, np.float32)
  m = np.asarray(mask, bool)
  d = np.where(m, pi.astype(np.float64) - mu.astype(np.float64), 0.0)
  n = int(m.sum())
  count = m.sum(axis=1)
  rows = count > 0
  geo = np.exp(d.sum(axis=1)[rows] / count[rows])
  out: dict[str, float] = {'tokens': float(n), 'sequences': float(rows.sum())}
  for label, b in BANDS:
    out[f'token_{label}'] = _fraction(np.abs(np.exp(d) - 1) <= b, m)
    out[f'seq_{label}'] = _mean(np.abs(geo - 1) <= b)
  out['max_abs_dlogp'] = float(np.abs(d).max()) if n else float('nan')
  k3 = _k3(jnp.asarray(d, jnp.float32), pi, mu, m)
  out['k3'] = _fraction(k3, m)
  out['bitwise'] = _fraction(_bits_equal(pi, mu), m)
  if argmax_pi is not None:
    am = np.ones(np.shape(argmax_pi), bool)
    if argmax_mask is not None:
      am = np.asarray(argmax_mask, bool)
    same = np.asarray(argmax_pi) == np.asarray(argmax_mu)
    out['argmax'] = _fraction(same, am)
  return out


def _fraction(x: np.ndarray, m: np.ndarray) -> float:
  """Mean of `x` over the True entries of `m` (NaN when none)."""
  return _mean(np.asarray(x, np.float64)[m])


def _mean(x: np.ndarray) -> float:
  return float(np.mean(x)) if np.size(x) else float('nan')
