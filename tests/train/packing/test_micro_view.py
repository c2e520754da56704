"""Token-budget micro-batches change no loss or gradient, for every
correction preset and aggregation mode.

With `train.packing` a micro-batch's loss sees the whole mini-batch, the
rows of other micro-batches with their response mask off
(`packing.forward.micro_view`), and the micro-batches are formed by token
count (`layout.balanced`). Summed over the micro-batches, the loss, its
gradient w.r.t. the log-probs and the summed/extreme metrics must be those
of one call on the mini-batch (what the unpacked update computes). The
objective is called as `jaxcorr.train.step._actor_loss` calls it: decoupled with the
correction of the whole batch and global counts, bypass with unit counts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import presets
from jaxcorr.losses import aggregate, objective
from jaxcorr.losses import correction as corr_lib
from jaxcorr.train.packing import forward, layout
from tests.helpers import objective_batches as ob
from tests.helpers.tolerance import TOL_GOLDEN, assert_close

TOL = TOL_GOLDEN  # 1e-6: a sum of float32 parts
SUMMED = ('actor/loss_token_count', 'actor/loss_seq_count')


def _calls(actor, cc, data, members):
  """[(loss, metrics, grad)] of the objective on the mini-batch with only
  the rows of each `members` mask [B] in the response mask."""
  d = dict(data)
  logp = jnp.asarray(d.pop('logp'))
  mask = d.pop('mask')
  bypass = cc is not None and cc.mode == 'bypass'
  kw = {}
  if bypass:
    d.pop('old_logp')
    counts = (jnp.float32(1), jnp.float32(1))
  else:
    m = mask
    if cc is not None:
      c = corr_lib.rollout_correction(
        d['old_logp'], d['rollout_logp'], mask, cc
      )
      kw['correction'] = corr_lib.Correction(c.weights, c.mask, {})
      m = mask & c.mask
    counts = objective.loss_normalizers(m)

  @jax.jit
  def one(lp, mask, kw):
    def f(lp):
      return objective.actor_objective(
        actor,
        cc,
        logp=lp,
        mask=mask,
        num_tokens=counts[0],
        num_seqs=counts[1],
        norm=mask.shape[1],
        key=jax.random.PRNGKey(0),
        **d,
        **kw,
      )

    return jax.value_and_grad(f, has_aux=True)(lp)

  out = []
  for member in members:
    view = forward.micro_view(
      _Rows(response_mask=jnp.asarray(mask)), jnp.asarray(member)
    )
    (loss, met), g = one(logp, view.response_mask, kw)
    out.append((float(loss), jax.device_get(met), np.asarray(g)))
  return out


@dataclasses.dataclass(frozen=True)
class _Rows:
  """The one field `micro_view` reads of a `TrainBatch`."""

  response_mask: jax.Array

  def replace(self, **kw):
    return dataclasses.replace(self, **kw)


def _check(actor, cc):
  data = ob.batch(seed=1, b=8, t=12)
  lengths = data['mask'].sum(1)
  micros = layout.balanced(lengths, 3)
  members = [np.isin(np.arange(8), ix) for ix in micros]
  (whole,) = _calls(actor, cc, data, [np.ones(8, bool)])
  parts = _calls(actor, cc, data, members)
  assert_close(sum(p[0] for p in parts), whole[0], TOL, what='loss')
  assert_close(sum(p[2] for p in parts), whole[2], TOL, what='grad')
  return whole
  for k, v in whole[1].items():
    got = [p[1][k] for p in parts]
    if k in SUMMED or k == 'actor/pg_loss':
      assert_close(sum(got), v, TOL, what=k)
    elif k.startswith('actor/') and k.endswith('max'):
      assert_close(max(got), v, TOL, what=k)


# One preset of each family in the default run, the rest marked slow.
FAST = (
  'disabled',
  'decoupled_seq_is_rs',
  'bypass_ppo_clip_geo_rs',
  'bypass_pg_is',
  'slime_mis',
  'decoupled_topr',
)


@pytest.mark.parametrize(
  'name',
  [
    n if n in FAST else pytest.param(n, marks=pytest.mark.slow)
    for n in presets.PRESETS
  ],
)
def test_every_preset(name):
  whole = _check(*ob.preset(name))
  if name == 'disabled':  # the check can fail: the gradient is not zero
    assert np.abs(whole[2]).max() > 0


@pytest.mark.parametrize('mode', aggregate.MODES)
def test_every_aggregation(mode):
  actor, cc = ob.preset('decoupled_token_is')
  whole = _check(dataclasses.replace(actor, agg=mode), cc)
  assert np.abs(whole[2]).max() > 0
