"""Overlong shaping and VCPO in the RL step: the host side (`assemble`,
`rollout_metrics`), what the update reads (`loss_batch.for_update`), the
config-time errors and two whole steps (the ESS scale multiplies the
update; on-policy VCPO is plain GRPO)."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.rollout.types import FinishReason
from jaxcorr.train import batch as batch_lib
from jaxcorr.train import build, loss_batch
from jaxcorr.train import step as step_lib
from tests.helpers.model_testing import fresh_train_state
from tests.helpers.step_batches import B, T, one_device_mesh, synthetic_rollout
from tests.helpers.trainer_config import pulse_config

DECOUPLED = 'decoupled_token_is'
LENGTH, STOP = FinishReason.LENGTH, FinishReason.STOP


def _run(preset=DECOUPLED, **overrides):
  return build.build(
    pulse_config(preset, train__shuffle_minibatches=False, **overrides)
  )


def _multi_turn_rollout():
  """`synthetic_rollout` with rows 0 and 4 truncated (finish LENGTH) and
  row 1's token 1 an environment token: in the context, not the loss."""
  rb, rew = synthetic_rollout()
  finish = np.full(B, STOP, np.int8)
  finish[[0, 4]] = LENGTH
  resp = np.asarray(rb.response_mask).copy()
  ctx = np.asarray(rb.context_mask).copy()
  ctx[1, :3] = True
  resp[1, :3] = [True, False, True]
  return rb.replace(
    finish_reason=finish, response_mask=resp, context_mask=ctx
  ), rew


def _assemble(run, rb, rew):
  return batch_lib.assemble(
    rb,
    rew,
    trainer_version=0,
    max_staleness=None,
    logprob_mode='full',
    row_multiple=1,
    overlong=run.reward,
    max_len=run.rollout.max_new_tokens,
  )


def _shaping(at: str, **more):
  return _run(
    reward__overlong_buffer_enable=True,
    reward__overlong_buffer_len=2,
    reward__overlong_penalty_at=at,
    **more,
  )


def test_penalty_at_reward_time_counts_environment_tokens():
  run = _shaping('reward')
  rb, rew = _multi_turn_rollout()
  out = _assemble(run, rb, rew)
  length = np.asarray(rb.context_mask).sum(1)
  l_max = run.rollout.max_new_tokens
  want = np.minimum(-(length - (l_max - 2)) / 2, 0.0)
  np.testing.assert_allclose(out.seq_reward, rew + want, rtol=1e-6)
  assert out.overlong_penalty is None and out.truncated is None
  agent_only = np.minimum(-(np.asarray(rb.response_mask).sum(1) - 3) / 2, 0)
  assert want[1] != agent_only[1]  # row 1's environment token counts
  m = batch_lib.rollout_metrics(
    rb,
    rew,
    trainer_version=0,
    max_staleness=None,
    overlong=run.reward,
    max_len=l_max,
  )
  assert m['overlong/penalty_mean'].value == pytest.approx(want.mean())
  assert m['overlong/penalized_fraction'].value == (want < 0).mean()
  assert m['reward/mean'].value == pytest.approx(rew.mean())  # the score


def test_penalty_at_loss_time_and_the_filter_ride_on_the_batch():
  run = _shaping('loss', reward__mask_truncated_completions=True)
  rb, rew = _multi_turn_rollout()
  out = _assemble(run, rb, rew)
  np.testing.assert_array_equal(out.seq_reward, rew)
  np.testing.assert_array_equal(out.truncated, np.isin(np.arange(B), [0, 4]))
  assert out.overlong_penalty.shape == (B,)
  padded = batch_lib.pad_rows(out, B + 2)
  assert (
    not padded.truncated[B:].any() and not padded.overlong_penalty[B:].any()
  )


def test_off_by_default_adds_no_field():
  rb, rew = _multi_turn_rollout()
  out = _assemble(_run(), rb, rew)
  assert out.truncated is None and out.overlong_penalty is None
  np.testing.assert_array_equal(out.seq_reward, rew)


def _prepared(rows=B):
  """A device-free stand-in for prepare's output: advantages set."""
  rb, rew = _multi_turn_rollout()
  out = _assemble(
    _shaping('loss', reward__mask_truncated_completions=True), rb, rew
  )
  rng = np.random.default_rng(3)
  adv = np.where(out.response_mask, rng.normal(size=(rows, T)), 0)
  old = np.where(out.response_mask, out.rollout_logp + 0.1, 0)
  return out.replace(
    advantages=adv.astype(np.float32), old_logp=old.astype(np.float32)
  )


def test_loss_time_shaping_keeps_the_baseline_and_drops_the_rows():
  run = _shaping('loss', reward__mask_truncated_completions=True)
  b = _prepared()
  got, metrics = loss_batch.for_update(run, b, None, None, None)
  assert metrics == {}
  keep = ~np.isin(np.arange(B), [0, 4])
  mask = np.asarray(b.response_mask)
  np.testing.assert_array_equal(got.response_mask, mask & keep[:, None])
  shift = np.where(mask, b.overlong_penalty[:, None], 0)
  np.testing.assert_allclose(got.advantages, b.advantages + shift, rtol=1e-6)


def test_opob_is_taken_before_the_filter():
  """A truncated row stays in its group's baseline (TRL's semantics)."""
  run = _run(
    reward__mask_truncated_completions=True,
    actor__grad_baselining=True,
    actor__baseline_score_norm='uniform',
    actor__baseline_use_is_weights=False,
  )
  b = _prepared().replace(overlong_penalty=None)
  no_state = types.SimpleNamespace(params=None)  # uniform norms: no params
  got, metrics = loss_batch.for_update(run, b, None, None, no_state)
  r = np.asarray(b.seq_reward).reshape(2, 4)
  mean = np.repeat(r.mean(1), 4)  # truncated rows 0 and 4 included
  row = np.asarray(got.advantages)[np.arange(B), 0]
  keep = ~np.isin(np.arange(B), [0, 4])
  np.testing.assert_allclose(row[keep], (b.seq_reward - mean)[keep], atol=1e-6)
  assert not np.asarray(got.response_mask)[[0, 4]].any()
  assert float(metrics['vcpo/score_sq_norm_mean']) == 1.0


def test_exact_score_norms_are_per_row_gradients():
  b = _prepared()
  w = jnp.linspace(-1.0, 1.0, T)

  def row_logp(params, row):  # a stand-in policy, linear in its params
    return jnp.sum(jnp.where(row.response_mask, params * row.rollout_logp, 0))

  got = loss_batch.score_sq_norms(row_logp, w, jax.tree.map(jnp.asarray, b))
  mu = np.where(b.response_mask, b.rollout_logp, 0)
  np.testing.assert_allclose(got, (mu**2).sum(1), rtol=1e-5)


@pytest.mark.parametrize('chunk', [1, 3, B])
def test_score_norms_are_the_same_in_any_chunk(monkeypatch, chunk):
  """Rows vmapped in chunks of 1, 3 (a remainder) or all B give the same
  norms as row by row."""
  b = jax.tree.map(jnp.asarray, _prepared())
  w = jnp.linspace(-1.0, 1.0, T)

  def row_logp(params, row):
    return jnp.sum(
      jnp.where(row.response_mask, jnp.sin(params) * row.rollout_logp, 0)
    )

  want = loss_batch.score_sq_norms(row_logp, w, b)
  monkeypatch.setattr(loss_batch, 'SCORE_CHUNK_BYTES', chunk * w.size * 4)
  assert loss_batch.score_chunk_rows(w, B) == chunk
  got = loss_batch.score_sq_norms(row_logp, w, b)
  np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize(
  ('overrides', 'field'),
  [
    (
      {
        'reward__overlong_buffer_enable': True,
        'reward__overlong_buffer_len': 999,
      },
      'config.reward.overlong_buffer_len',
    ),
    (
      {
        'reward__overlong_buffer_enable': True,
        'reward__overlong_buffer_len': 0,
      },
      'config.reward.overlong_buffer_len',
    ),
    ({'actor__ess_scaling': True}, 'actor.ess_scaling'),
    ({'actor__grad_baselining': True}, 'actor.grad_baselining'),
  ],
)
def test_bad_settings_fail_at_build_naming_the_field(overrides, field):
  preset = '' if field.startswith('actor') else DECOUPLED
  with pytest.raises(ValueError, match=field.replace('.', r'\.')):
    _run(preset, **overrides)


def test_opob_needs_grpo_without_kl_in_reward():
  with pytest.raises(ValueError, match=r"actor\.grad_baselining.*'rloo'"):
    _run(actor__grad_baselining=True, algorithm__estimator='rloo')
  _run(actor__grad_baselining=True)
  _run(actor__ess_scaling=True, algorithm__estimator='rloo')


def test_vcpo_in_bypass_mode_fails_at_build():
  with pytest.raises(ValueError, match=r"correction.mode='bypass'"):
    _run('bypass_pg_is', actor__ess_scaling=True)


# ------------------------------------------------------------ whole steps

SMALL = dict(train__mini_batches=1, train__micro_batches=1)
VCPO_GRPO = dict(
  actor__ess_scaling=True,
  actor__grad_baselining=True,
  actor__baseline_score_norm='uniform',
  actor__baseline_use_is_weights=False,
  actor__baseline_norm_by_std=True,
)


def _arrays(run):
  rb, rew = synthetic_rollout()
  return _assemble(run, rb, rew)


@pytest.fixture(scope='module')
def plain():
  """(run, state, steps, prepared batch) of a decoupled GRPO step; the
  prepared batch does not depend on the VCPO fields (they act after it)."""
  run = _run(**SMALL)
  mesh = one_device_mesh()
  state, steps = fresh_train_state(run, mesh)
  with jax.set_mesh(mesh):
    dev = batch_lib.to_device(mesh, _arrays(run))
    _, prepared, _ = steps.prepare(state.params, None, state.kl_ctrl, None, dev)
  return run, state, steps, prepared


def _updates(state, steps, prepared):
  """Δθ and metrics of one update, off-policy (the synthetic μ) and
  on-policy (μ := π_old, as if the engine were the trainer), from the same
  state with the same compiled update."""
  before = jax.device_get(state.params)
  out = []
  with jax.set_mesh(one_device_mesh()):
    for b in (prepared, prepared.replace(rollout_logp=prepared.old_logp)):
      start = jax.tree.map(jnp.copy, state)  # the update donates its state
      after, metrics = steps.update(start, b)
      leaves = jax.tree.leaves(jax.device_get(after.params))
      delta = [
        np.asarray(a) - np.asarray(p)
        for a, p in zip(leaves, jax.tree.leaves(before), strict=True)
      ]
      out.append((delta, jax.device_get(metrics)))
  return out


def test_vcpo_step_scales_the_update_and_is_grpo_on_policy(plain):
  """With the baseline weighed by norms only (uniform, no w²) b_g is the
  group mean whatever μ is, so VCPO's update is GRPO's times the ESS scale
  s: s < 1 off-policy, s = 1 and the very same update on-policy."""
  _, state, steps, prepared = plain
  vcpo_run = _run(**SMALL, **VCPO_GRPO)
  vcpo_steps = step_lib.Steps(
    vcpo_run, steps.graphdef, steps.tx, steps.schedule
  )
  (off0, _), (on0, _) = _updates(state, steps, prepared)
  (off1, m_off), (on1, m_on) = _updates(state, vcpo_steps, prepared)
  assert min(np.abs(d).max() for d in off0) > 0  # every leaf moves
  s = float(m_off['vcpo/step_scale'])
  assert 0.0 < s < 1.0
  np.testing.assert_allclose(m_off['vcpo/ess_ratio'] ** 0.5, s, rtol=1e-6)
  assert float(m_on['vcpo/step_scale']) == 1.0
  for d0, d1 in zip(off0, off1, strict=True):
    np.testing.assert_allclose(d1, s * d0, rtol=2e-4, atol=1e-9)
  for d0, d1 in zip(on0, on1, strict=True):
    np.testing.assert_allclose(d1, d0, rtol=1e-4, atol=1e-9)


def _row(i, x):
  return x[i : i + 1]


def test_exact_score_norms_of_the_policy(plain):
  """`step._row_logp` through `score_sq_norms`: ‖∇θ Σ_t log π_θ(y_t)‖² of
  each row, as `jax.grad` of that row alone."""
  _, state, steps, prepared = plain
  rows = jax.tree.map(lambda x: x[:2], prepared)
  row_logp = functools.partial(
    step_lib._row_logp, steps.run, steps.graphdef, None, jax.random.key(0)
  )
  got = jax.jit(functools.partial(loss_batch.score_sq_norms, row_logp))(
    state.params, rows
  )
  grad = jax.jit(jax.grad(row_logp))
  for i in range(2):
    g = grad(state.params, jax.tree.map(functools.partial(_row, i), rows))
    want = sum(float(jnp.sum(jnp.square(x))) for x in jax.tree.leaves(g))
    np.testing.assert_allclose(got[i], want, rtol=1e-4)
  assert np.all(np.asarray(got) > 0)
