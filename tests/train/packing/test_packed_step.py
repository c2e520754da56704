"""`train.packing`: the packed update equals the unpacked one.

The synthetic step batch, its rows widened so that several sequences share
each packed row, goes through `Steps.prepare` + `Steps.update` unpacked and
packed; the metrics must agree within float32 reordering (1e-6), the
updated params within Adam's amplification of it (`TOL_LAYOUT`), and
attention must never cross sequences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr import sharding
from jaxcorr.train import batch as batch_lib
from jaxcorr.train import build
from jaxcorr.train.packing import forward, layout
from tests.helpers.model_testing import fresh_train_state
from tests.helpers.step_batches import one_device_mesh, step_arrays
from tests.helpers.tolerance import (
  TOL_GOLDEN,
  TOL_LAYOUT,
  TOL_LAYOUT_SHARDED,
  assert_close,
)
from tests.helpers.trainer_config import pulse_config
from tests.helpers.wide_rows import widen


def _run(preset, **train):
  """The pulse run of `preset`; `train` fields, or `section__field` keys."""
  overrides = {k if '__' in k else f'train__{k}': v for k, v in train.items()}
  return build.build(
    pulse_config(
      preset,
      train__shuffle_minibatches=False,
      optim__warmup_steps=0,  # the first update moves the params
      **overrides,
    )
  )


def _step(run, arrays, packed=None, mesh=None):
  """(params before, params after, metrics) of one prepare + update; with
  a critic, `params` is (policy, critic)."""
  mesh = mesh or one_device_mesh()
  state, steps = fresh_train_state(run, mesh, sharded=True)
  # A copy: the update donates the state (a CPU buffer's numpy view would
  # see the new values).
  trained = lambda s: (s.params, s.critic_params)  # noqa: E731
  before = jax.tree.map(np.array, jax.device_get(trained(state)))
  with jax.set_mesh(mesh):
    dev = batch_lib.to_device(mesh, arrays)
    pk = None if packed is None else forward.to_device(mesh, packed)
    _, prepared, prep = steps.prepare(
      state.params, state.critic_params, state.kl_ctrl, None, dev, pk
    )
    state, upd = steps.update(state, prepared, pk)
  after = jax.device_get(trained(state))
  return before, after, jax.device_get({**prep, **upd})


def _compare(preset, *, micro, skip=lambda k: False, moves=True, **config):
  t = dict(mini_batches=2, micro_batches=micro)
  run = _run(preset, **t, **config)
  arrays = widen(step_arrays(run, 8), 11)
  packed = layout.pack(arrays, mini_batches=2, micro_batches=micro)
  assert packed.segment_ids.max() >= 2  # rows hold several sequences
  before, a, ma = _step(run, arrays)
  _, b, mb = _step(run, arrays, packed)
  moved = max(
    float(np.abs(x - y).max())
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(a))
  )
  assert moved > 0 or not moves, ma['actor/grad_norm']
  # Params after Adam: float32 reordering of the weight gradients (other
  # row lengths, other token counts per product) is amplified by
  # m / sqrt(v) on near-zero gradients; the losses and gradients themselves
  # are compared at 1e-6 in tests/train/packing/test_micro_view.py.
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert_close(y, x, TOL_LAYOUT, what='params')
  assert set(ma) == set(mb)
  for k in ma:
    if not skip(k):
      assert_close(mb[k], ma[k], TOL_GOLDEN, what=k)
  return ma


def test_packed_step_equals_unpacked():
  """Decoupled, sequence-level IS, one micro-batch per mini-batch: params
  and every metric."""
  _compare('decoupled_seq_is', micro=1)


def test_packed_step_with_a_critic_equals_unpacked():
  """PPO with GAE: the critic's values in prepare and its value loss in
  the update read the packed rows too (policy and critic params, every
  metric, `critic/` ones included)."""
  metrics = _compare(
    'decoupled_seq_is',
    micro=1,
    critic__enabled=True,
    algorithm__estimator='gae',
    algorithm__gamma=1.0,
    algorithm__lam=0.95,
  )
  assert metrics['critic/values_mean'] != 0  # the values reach the loss
  assert metrics['critic/grad_norm'] > 0


def _per_call(k):
  """Means over a micro-batch's own rows (clip fractions; bypass mode's
  correction statistics): token-budget micro-batches hold other rows than
  the strided ones (tests/train/test_step.py)."""
  per_call = k.startswith('actor/pg_clip') or k == 'actor/ppo_kl'
  return per_call or (
    k.startswith('rollout_corr/') and not k.endswith(('max', 'min'))
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  'preset', ['bypass_ppo_clip_geo_rs', 'decoupled_seq_is_rs', 'slime_mis']
)
def test_packed_step_with_micro_batches(preset):
  # The rejections may drop every row of this random batch: no move.
  _compare(preset, micro=2, skip=_per_call, moves=False)


def test_attention_stays_inside_a_sequence():
  """Changing one packed sequence's tokens changes no other sequence's
  log-probs."""
  run = _run('disabled')
  arrays = widen(step_arrays(run, 8), 11)
  packed = layout.pack(arrays, mini_batches=1, micro_batches=1)
  micro = jax.tree.map(
    lambda x: jnp.asarray(x[0, 0]), packed.replace(rows=None)
  )
  state, steps = fresh_train_state(run, one_device_mesh())
  logp = jax.jit(lambda p, m: forward.response_logp(run, steps.graphdef, p, m))
  base = logp(state.params, micro)
  row = int(np.nonzero(np.asarray(micro.segment_ids).max(1) >= 2)[0][0])
  seg1 = np.asarray(micro.segment_ids[row]) == 1
  tokens = np.asarray(micro.tokens).copy()
  tokens[row, seg1] = (tokens[row, seg1] + 1) % 10 + 3
  moved = logp(state.params, micro.replace(tokens=jnp.asarray(tokens)))
  diff = np.abs(np.asarray(moved - base)) * arrays.response_mask
  changed = diff.max(1) > 0  # per batch row, on its trained tokens
  mask = arrays.response_mask.any(1)
  owner = _owner(packed, arrays.response_mask, row)  # segment 1's row
  assert changed[owner]
  others = mask & (np.arange(arrays.rows) != owner)
  assert not changed[others].any()


def _owner(packed, mask, row):
  """The batch row whose trained tokens are read from packed row `row`,
  segment 1."""
  length = packed.tokens.shape[-1]
  seg = packed.segment_ids[0, 0].reshape(-1)
  for j, b in enumerate(packed.rows[0]):
    g = packed.gather[0, 0, j][mask[b]]
    hit = (g // length == row) & (seg[g] == 1)
    if hit.any():
      return int(b)
  raise AssertionError('no batch row in segment 1')


@pytest.mark.slow
def test_packed_sharded_equals_unpacked_single_device():
  """Packed rows split over 8 fake devices (data 2 x fsdp 4) vs the
  unpacked step on one device."""
  run = _run('decoupled_geo_rs', mini_batches=1, micro_batches=1)
  arrays = widen(step_arrays(run, 8), 11)
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=4))
  packed = layout.pack(arrays, mini_batches=1, micro_batches=1, shards=8)
  _, a, ma = _step(run, arrays)
  _, b, mb = _step(run, arrays, packed, mesh=mesh)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert_close(y, x, TOL_LAYOUT_SHARDED, what='params')
  for k in ma:
    assert_close(mb[k], ma[k], TOL_LAYOUT_SHARDED, what=k)
