"""Calls of the actor objective and the synthetic batches its tests share.

`batch()` is a random `[B, T]` batch with an empty row, a hole and two rows
whose rollout log-probs are far off; `run_objective` corrects it (decoupled)
and returns the objective's value, metrics and gradient w.r.t. `logp`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from configs import base as base_config
from jaxcorr.losses import correction as corr_lib
from jaxcorr.losses import objective as obj
from jaxcorr.train import build


def grad_logp(cfg, corr_cfg, logp, *, jit=False, **kw):
  """loss, metrics and d loss / d logp. `jit=True` for one-off shapes: one
  XLA compile is much cheaper than compiling every eager op anew."""

  def f(lp, kw):
    return obj.actor_objective(cfg, corr_cfg, logp=lp, **kw)

  vg = jax.value_and_grad(f, has_aux=True)
  (loss, metrics), grad = (jax.jit(vg) if jit else vg)(jnp.asarray(logp), kw)
  return loss, metrics, np.asarray(grad)


def preset(name):
  """(ActorLossConfig, CorrectionConfig | None) of a jaxcorr preset."""
  return build.losses(base_config.get_config(name))


def np_aggregate(per_tok, m, mode, *, n_tok=None, n_seq=None, norm=None):
  """A float64 numpy aggregation, written from the spec table."""
  per_tok = np.where(m, per_tok, 0.0).astype(np.float64)
  n_i = m.sum(-1)
  n_tok = m.sum() if n_tok is None else n_tok
  n_seq = (n_i > 0).sum() if n_seq is None else n_seq
  rows = per_tok.sum(-1)
  if mode == 'token_mean':
    return rows.sum() / n_tok if n_tok else 0.0
  if mode == 'token_sum':
    return rows.sum()
  if mode == 'seq_mean_token_mean':
    rows = np.where(n_i > 0, rows / np.maximum(n_i, 1), 0)
  out = rows.sum() / n_seq if n_seq else 0.0
  if mode == 'seq_mean_token_sum_norm':
    out /= per_tok.shape[-1] if norm is None else norm
  return out


def batch(seed=0, b=8, t=12, shift_rows=(2, 5)):
  """Random batch with an empty row, a hole, and two badly mismatched rows."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(2, t + 1, size=b)
  lengths[0], lengths[3] = t, 0
  mask = np.arange(t)[None] < lengths[:, None]
  mask[1, 1:3] = False
  f32 = np.float32
  old = -np.abs(rng.normal(1.0, 0.5, (b, t))).astype(f32)
  ro = old + rng.normal(0, 0.05, (b, t)).astype(f32)
  ro[list(shift_rows)] -= 0.6
  return dict(
    logp=old + rng.normal(0, 0.1, (b, t)).astype(f32),
    old_logp=old,
    rollout_logp=ro,
    ref_logp=old + rng.normal(0, 0.1, (b, t)).astype(f32),
    advantages=rng.normal(size=(b, t)).astype(f32),
    entropy=rng.uniform(0.5, 2.0, (b, t)).astype(f32),
    mask=mask,
  )


# A sequence-level rejection that drops some rows of `batch()` (its
# mismatched ones), decoupled and bypass.
RS_DECOUPLED = corr_lib.CorrectionConfig(
  is_level='token', rs='seq_mean_k3', rs_bounds=0.01
)
RS_BYPASS = corr_lib.CorrectionConfig(
  mode='bypass',
  bypass_loss='reinforce',
  is_level='token',
  rs='seq_mean_k3',
  rs_bounds=0.01,
)
# Every optional term of the objective switched on.
ALL_TERMS = dict(entropy_coeff=0.01, kl_loss_coef=0.1, rollout_kl_coef=0.05)


def rows(d, s):
  """Rows `s` of every array of `d`."""
  return {k: v[s] for k, v in d.items()}


def run_objective(actor, cc, data, correction=None, **kw):
  """value, metrics, grad(logp) of the objective on a data dict."""
  d = dict(data)
  logp = d.pop('logp')
  if cc is not None and cc.mode == 'bypass':
    d.pop('old_logp', None)
  elif cc is not None and correction is None:
    correction = corr_lib.rollout_correction(
      d['old_logp'], d['rollout_logp'], d['mask'], cc
    )
  return grad_logp(actor, cc, logp, correction=correction, **d, **kw)
