"""Per-token staleness on the trainer side (jaxcorr/train/rollouts/staleness.py):
`rollout.staleness_policy` on exact rows and tokens, the `staleness/`
metrics against plain Python loops, the version gap reaching the
correction's `rollout_corr/gap<g>/` metrics through `RLStep`, and missing
rollout log-probs failing loudly.

The batches mix versions inside rows, as a stream-mode engine that swaps
weights mid-sequence delivers them (versions never decrease along a row).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.losses import correction as corr_lib
from jaxcorr.losses import objective
from jaxcorr.rollout import ValidationConfig, validate_rollout_batch
from jaxcorr.rollout.types import FinishReason, RolloutBatch
from jaxcorr.train import batch as batch_lib
from jaxcorr.train import build
from jaxcorr.train.rl_step import RLStep
from jaxcorr.train.rollouts import staleness
from jaxcorr.train.rollouts.stage import Scored
from jaxcorr.train.tracker import reduction
from jaxcorr.train.tracker.reduction import Metric
from tests.helpers.model_testing import fresh_train_state
from tests.helpers.step_batches import one_device_mesh
from tests.helpers.trainer_config import pulse_config

STOP, ABORT, PAD = FinishReason.STOP, FinishReason.ABORT, FinishReason.PAD


def rollout_batch(version, finish, *, seed=0, p=3) -> RolloutBatch:
  """A valid host batch with the given [B, T] versions (-1: no token;
  tokens are a prefix of each row) and [B] finish reasons."""
  version = np.asarray(version, np.int32)
  finish = np.asarray(finish, np.int8)
  b, t = version.shape
  rng = np.random.default_rng(seed)
  mask = version >= 0
  logp = np.where(mask, -rng.uniform(0.1, 2.0, (b, t)), 0).astype(np.float32)
  real = finish != PAD
  return RolloutBatch(
    prompt_tokens=np.where(
      real[:, None], rng.integers(3, 20, (b, p)), 0
    ).astype(np.int32),
    prompt_mask=np.repeat(real[:, None], p, 1),
    response_tokens=np.where(mask, rng.integers(3, 20, (b, t)), 0).astype(
      np.int32
    ),
    context_mask=mask.copy(),
    response_mask=mask,
    rollout_logp=logp,
    rollout_logp_truncated=logp.copy(),
    temperature=np.ones(b, np.float32),
    top_k=np.zeros(b, np.int32),
    top_p=np.ones(b, np.float32),
    min_p=np.zeros(b, np.float32),
    policy_version=version,
    finish_reason=finish,
    group_id=(np.arange(b) // 4).astype(np.int32),
    sample_id=(np.arange(b) % 4).astype(np.int32),
  )


N = -1  # no token
# Trainer version 5, max_staleness 2: gaps above 2 are stale.
VERSIONS = [
  [3, 3, 4, 5, 5, N],  # 0: fresh, three versions
  [1, 2, 3, 3, N, N],  # 1: two stale tokens, then fresh ones
  [1, 1, 1, N, N, N],  # 2: every token stale
  [5, 5, 5, 5, 5, 5],  # 3: fresh, one version
  [2, 4, N, N, N, N],  # 4: ABORT
  [N, N, N, N, N, N],  # 5: PAD
  [4, 5, 5, N, N, N],  # 6: fresh
  [0, 5, N, N, N, N],  # 7: first token stale, last one fresh
]
FINISH = [STOP, STOP, STOP, STOP, ABORT, PAD, STOP, STOP]
TV, MAX_STALE = 5, 2


def _assemble(batch, policy, trainer_version=TV, mode='full'):
  return batch_lib.assemble(
    batch,
    np.arange(batch.batch_size, dtype=np.float32) + 1,
    trainer_version=trainer_version,
    max_staleness=MAX_STALE,
    logprob_mode=mode,
    row_multiple=1,
    staleness_policy=policy,
  )


@pytest.mark.parametrize('policy', ['wait', 'drop'])
def test_wait_and_drop_empty_every_row_with_a_stale_token(policy):
  batch = rollout_batch(VERSIONS, FINISH)
  kept, stale = batch_lib.keep_rows(batch, TV, MAX_STALE, policy)
  np.testing.assert_array_equal(kept, [1, 0, 0, 1, 0, 0, 1, 0])
  np.testing.assert_array_equal(stale, [0, 1, 1, 0, 0, 0, 0, 1])
  out = _assemble(batch, policy)
  mask = np.asarray(VERSIONS) >= 0
  np.testing.assert_array_equal(out.response_mask, mask & kept[:, None])
  np.testing.assert_array_equal(
    out.seq_reward, np.where(kept, 1 + np.arange(8), 0)
  )


def test_mask_removes_only_stale_tokens():
  batch = rollout_batch(VERSIONS, FINISH)
  kept, stale = batch_lib.keep_rows(batch, TV, MAX_STALE, 'mask')
  # Row 2 is left without tokens (an empty row); rows 1 and 7 keep some.
  np.testing.assert_array_equal(kept, [1, 1, 0, 1, 0, 0, 1, 1])
  np.testing.assert_array_equal(stale, [0, 0, 1, 0, 0, 0, 0, 0])
  out = _assemble(batch, 'mask')
  want = np.asarray(VERSIONS) >= TV - MAX_STALE
  want[[2, 4, 5]] = False
  np.testing.assert_array_equal(out.response_mask, want)
  np.testing.assert_array_equal(
    out.seq_reward, np.where(kept, 1 + np.arange(8), 0)
  )
  # μ and the version gaps are zeros off the mask, the gap on it.
  gap = TV - np.asarray(VERSIONS)
  np.testing.assert_array_equal(out.version_gap, np.where(want, gap, 0))
  assert out.version_gap.dtype == np.int32
  np.testing.assert_array_equal(out.rollout_logp != 0, want)
  # Masked stale tokens stay in the context the trainer conditions on.
  p = batch.prompt_tokens.shape[1]
  np.testing.assert_array_equal(out.segment_ids[1, p : p + 4], 1)


def test_a_masked_stale_token_leaves_the_sequence_statistics():
  """The correction sees the one mask: a sequence-level IS weight sums the
  log-ratio over the row's fresh tokens only."""
  batch = rollout_batch(VERSIONS, FINISH)
  out = _assemble(batch, 'mask')
  rng = np.random.default_rng(1)
  train = out.rollout_logp + rng.normal(0, 0.3, out.rollout_logp.shape)
  train = train.astype(np.float32)
  cfg = corr_lib.CorrectionConfig(
    mode='decoupled', is_level='sequence', is_mode='truncate', is_upper=1e6
  )
  c = corr_lib.rollout_correction(
    train, out.rollout_logp, out.response_mask, cfg
  )
  m = out.response_mask
  s = np.where(m, train - out.rollout_logp, 0).sum(1)
  want = np.where(m, np.exp(s)[:, None], 0)
  np.testing.assert_allclose(np.asarray(c.weights), want, rtol=1e-5)


# A multi-turn batch (docs/agents.md): E marks an environment token, in
# the context (the trainer conditions on it) with no version and outside
# response_mask; agent tokens carry the version that sampled them.
E = -2
AGENT_VERSIONS = [
  [1, 1, E, E, 4, 5],  # 0: first turn stale, second turn fresh
  [4, 4, E, E, 5, 5],  # 1: every agent token fresh
  [1, E, E, 1, 1, N],  # 2: every agent token stale
]


def agent_batch() -> RolloutBatch:
  v = np.asarray(AGENT_VERSIONS)
  batch = rollout_batch(np.where(v == E, 0, v), [STOP] * len(v))
  env = v == E
  return batch.replace(
    response_mask=batch.response_mask & ~env,
    policy_version=np.where(env, -1, v).astype(np.int32),
    rollout_logp=np.where(env, 0, batch.rollout_logp).astype(np.float32),
    rollout_logp_truncated=np.where(env, 0, batch.rollout_logp).astype(
      np.float32
    ),
  )


@pytest.mark.parametrize('policy', ['drop', 'mask'])
def test_environment_tokens_are_never_stale_and_stay_in_context(policy):
  """Stream mode with agents: an environment token's missing version (-1)
  is not a gap of TV + 1, so a fresh trajectory is not dropped for its
  observations; 'mask' removes a stale turn's agent tokens only; every
  environment token stays in the context the later turns attend to."""
  batch = agent_batch()
  v = np.asarray(AGENT_VERSIONS)
  env, agent = v == E, v >= 0
  kept, stale = batch_lib.keep_rows(batch, TV, MAX_STALE, policy)
  out = _assemble(batch, policy)
  if policy == 'drop':
    np.testing.assert_array_equal(kept, [0, 1, 0])
    np.testing.assert_array_equal(stale, [1, 0, 1])
    want = agent & kept[:, None]
  else:
    np.testing.assert_array_equal(kept, [1, 1, 0])
    np.testing.assert_array_equal(stale, [0, 0, 1])
    want = agent & (v >= TV - MAX_STALE)
  np.testing.assert_array_equal(out.response_mask, want)
  assert not (out.response_mask & env).any()
  p = batch.prompt_tokens.shape[1]
  np.testing.assert_array_equal(out.segment_ids[:, p:], agent | env)
  np.testing.assert_array_equal(
    out.version_gap, np.where(want, TV - v, 0).astype(np.int32)
  )


def test_unknown_policy_names_the_field():
  batch = rollout_batch(VERSIONS, FINISH)
  with pytest.raises(ValueError, match=r"staleness_policy='late'.*'mask'"):
    batch_lib.keep_rows(batch, TV, MAX_STALE, 'late')


def test_gap_buckets():
  assert staleness.gap_buckets('sync', None) is None
  assert staleness.gap_buckets('sync', 3) is None
  assert staleness.gap_buckets('async', 0) == 2
  assert staleness.gap_buckets('stream', 2) == 4
  assert staleness.gap_buckets('stream', 9) == staleness.MAX_GAP_BUCKETS


# ---------------------------------------------------------------- metrics


def random_mixed(seed: int, b: int = 24, t: int = 7, tv: int = 6):
  """Rows starting at a random version, swapping up at random tokens;
  some ABORT and PAD rows."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, t + 1, b)
  start = rng.integers(0, tv + 1, b)
  swaps = np.cumsum(rng.random((b, t)) < 0.35, 1)
  version = np.minimum(start[:, None] + swaps - swaps[:, :1], tv)
  finish = np.full(b, STOP)
  finish[rng.choice(b, 3, replace=False)] = ABORT
  finish[-3:] = PAD
  on = (np.arange(t)[None] < lengths[:, None]) & (finish != PAD)[:, None]
  return rollout_batch(np.where(on, version, -1), finish, seed=seed)


def reference(batch, tv, max_stale, policy, buckets):
  """The metrics by loops over rows and tokens."""
  tokens, rows = [], []
  for i in range(batch.batch_size):
    vs = [int(v) for v in batch.policy_version[i] if v >= 0]
    if batch.finish_reason[i] == PAD or not vs:
      continue
    live = batch.finish_reason[i] == STOP
    stale = [tv - v > max_stale for v in vs]
    if policy == 'mask':
      trains = [live and not all(stale) and not s for s in stale]
    else:
      trains = [live and not any(stale)] * len(vs)
    for v, k in zip(vs, trains):
      tokens.append((tv - v, max(vs) - v, tv - max(vs), k))
    gaps = [tv - v for v in vs]
    rows.append((max(gaps), sum(gaps) / len(gaps), len(set(vs))))
  tok = np.asarray(tokens, np.float64)
  row = np.asarray(rows, np.float64)
  out = {
    'staleness/token_mean': tok[:, 0].mean(),
    'staleness/token_max': tok[:, 0].max(),
    'staleness/inflight_mean': tok[:, 1].mean(),
    'staleness/queued_mean': tok[:, 2].mean(),
    'staleness/seq_max_mean': row[:, 0].mean(),
    'staleness/seq_mean_mean': row[:, 1].mean(),
    'rollout/versions_per_seq_mean': row[:, 2].mean(),
    'rollout/token_keep_fraction': tok[:, 3].mean(),
  }
  for g in range(buckets):
    for name, col in (('inflight', 1), ('queued', 2)):
      x = tok[:, col]
      hit = x >= g if g == buckets - 1 else x == g
      out[f'staleness/{name}_hist{g}'] = hit.mean()
  return out


@pytest.mark.parametrize('policy', ['wait', 'drop', 'mask'])
@pytest.mark.parametrize('seed', [0, 1])
def test_staleness_metrics_match_loops(policy, seed):
  batch = random_mixed(seed)
  tv, max_stale, g = 6, 1, staleness.gap_buckets('stream', 1)
  got = batch_lib.rollout_metrics(
    batch,
    np.zeros(batch.batch_size, np.float32),
    trainer_version=tv,
    max_staleness=max_stale,
    staleness_policy=policy,
    gap_buckets=g,
  )
  want = reference(batch, tv, max_stale, policy, g)
  new = {k for k in got if k.startswith('staleness/')}
  new |= {'rollout/versions_per_seq_mean', 'rollout/token_keep_fraction'}
  assert new == set(want)
  for k in want:
    np.testing.assert_allclose(got[k].value, want[k], rtol=1e-12, err_msg=k)
  assert got['staleness/token_max'].reduce is reduction.Reduce.MAX
  assert got['staleness/token_mean'].reduce is reduction.Reduce.WMEAN
  # The histograms are fractions of the same tokens; the parts add up.
  for name in ('inflight', 'queued'):
    total = sum(got[f'staleness/{name}_hist{i}'].value for i in range(g))
    np.testing.assert_allclose(total, 1.0, rtol=1e-12)
  np.testing.assert_allclose(
    got['staleness/inflight_mean'].value + got['staleness/queued_mean'].value,
    got['staleness/token_mean'].value,
    rtol=1e-12,
  )
  assert got['rollout/versions_per_seq_mean'].value > 1  # mixed rows


def test_sync_mode_adds_no_staleness_metrics():
  batch = random_mixed(0)
  m = batch_lib.rollout_metrics(
    batch, np.zeros(batch.batch_size), trainer_version=6, max_staleness=None
  )
  assert not [k for k in m if k.startswith('staleness/')]
  assert 'rollout/token_keep_fraction' not in m


def test_token_metrics_combine_over_processes_like_one():
  """Shares with different token and row counts (PAD rows in one share):
  the weighted means give the whole batch's values."""
  batch = random_mixed(2)
  reward = np.zeros(batch.batch_size, np.float32)

  def host(lo, hi):
    part = jax.tree.map(lambda x: x[lo:hi], batch)
    m = batch_lib.rollout_metrics(
      part,
      reward[lo:hi],
      trainer_version=6,
      max_staleness=1,
      staleness_policy='mask',
      gap_buckets=3,
    )
    return {k: v for k, v in m.items() if k.startswith('staleness/')}

  whole = reduction.values(host(0, 24))
  combined = reduction.combine_processes(
    [host(i, i + 6) for i in (0, 6, 12, 18)]
  )
  for k in whole:
    np.testing.assert_allclose(combined[k], whole[k], rtol=1e-12, err_msg=k)


def test_weighted_mean_reduces_in_jit():
  parts = Metric.wavg(
    jnp.asarray([0.5, 0.25, 0.0]), jnp.asarray([2.0, 6.0, 0.0])
  )
  out = jax.jit(reduction.reduce_parts)({'x': parts})['x']
  np.testing.assert_allclose(out.value, (0.5 * 2 + 0.25 * 6) / 8)
  assert float(out.weight) == 8.0
  empty = Metric.wavg(jnp.asarray([0.0, 0.0]), jnp.asarray([0.0, 0.0]))
  assert float(reduction.reduce_parts({'x': empty})['x'].value) == 0.0


# ------------------------------------------------ through the trainer step


def _rl_step(
  preset: str, batch: RolloutBatch, tv: int, policy: str, micro_batches=1
):
  c = pulse_config(
    preset,
    train__micro_batches=micro_batches,
    rollout__mode='stream',
    rollout__max_staleness=MAX_STALE,
    rollout__staleness_policy=policy,
    rollout__samples_per_prompt=4,
  )
  run = build.build(c)
  mesh = one_device_mesh()
  state, steps = fresh_train_state(run, mesh)
  rl = RLStep(run, steps, mesh, vocab_size=run.model.vocab_size, batch_shards=1)
  reward = np.random.default_rng(0).integers(0, 2, batch.batch_size)
  scored = Scored(
    step=tv, batch=batch, rewards=reward.astype(np.float32), metrics={}
  )
  return rl(state, None, scored, tv)[1]


@pytest.mark.parametrize('preset', ['decoupled_token_is', 'bypass_pg_is'])
def test_version_gap_reaches_the_correction(preset):
  """RLStep in stream mode with 'mask': the correction's per-gap token
  fractions are those of the trained tokens; nothing above max_staleness
  is left in the loss."""
  batch = rollout_batch(VERSIONS, FINISH)
  out = _rl_step(preset, batch, TV, 'mask')
  trained = batch_lib.keep_tokens(batch, TV, MAX_STALE, 'mask')
  gap = np.minimum(TV - np.asarray(VERSIONS), 3)[trained]
  assert out['batch/valid_tokens'] == trained.sum()
  for g in range(4):  # gap_buckets = max_staleness + 2
    np.testing.assert_allclose(
      out[f'rollout_corr/gap{g}/token_fraction'],
      (gap == g).mean(),
      rtol=1e-6,
      err_msg=str(g),
    )
  assert out['rollout_corr/gap3/token_fraction'] == 0
  assert 'rollout_corr/gap4/token_fraction' not in out
  # The host side of the same step (staleness.py), before the policy.
  assert out['staleness/token_max'] == TV - 0
  tokens = (np.asarray(VERSIONS) >= 0).sum()
  np.testing.assert_allclose(
    out['rollout/token_keep_fraction'], trained.sum() / tokens
  )


def _gap_parts(seed=0):
  """A [8, 6] bypass-style correction input with version gaps, split into
  two halves whose buckets hold different numbers of tokens."""
  rng = np.random.default_rng(seed)
  versions = np.asarray(VERSIONS)
  mask = jnp.asarray(versions >= 0)
  train = jnp.asarray(-rng.uniform(0.1, 2.0, versions.shape), jnp.float32)
  rollout = jnp.asarray(-rng.uniform(0.1, 2.0, versions.shape), jnp.float32)
  gap = jnp.asarray(np.where(versions >= 0, TV - versions, 0), jnp.int32)
  return train, rollout, mask, gap


GAP_MEANS = ('token_fraction', 'kl', 'k3_kl')  # exact token means


def test_gap_metrics_weighted_by_tokens_combine_to_the_whole_batch():
  """Per-part `rollout_corr/gap<g>/` values weighted by
  `gap_metric_weights` (Reduce.WMEAN) equal one call on the whole batch;
  the plain mean of the parts does not."""
  cfg = corr_lib.CorrectionConfig(mode='bypass', is_level='token')
  train, rollout, mask, gap = _gap_parts()
  kw = dict(gap_buckets=4)

  def corr(rows):
    c = corr_lib.rollout_correction(
      train[rows], rollout[rows], mask[rows], cfg, version_gap=gap[rows], **kw
    )
    w = corr_lib.gap_metric_weights(
      train[rows], rollout[rows], mask[rows], version_gap=gap[rows], **kw
    )
    return c.metrics, w

  whole, _ = corr(slice(None))
  parts = [corr(slice(0, 4)), corr(slice(4, 8))]
  gap_keys = {k for k in whole if k.startswith('rollout_corr/gap')}
  assert set(parts[0][1]) == gap_keys  # every gap metric has its weight
  stacked = {
    k: Metric.wavg(
      jnp.stack([m[k] for m, _ in parts]), jnp.stack([w[k] for _, w in parts])
    )
    for k in gap_keys
  }
  combined = reduction.values(reduction.reduce_parts(stacked))
  differs = 0
  for g in range(4):
    for name in GAP_MEANS:
      k = f'rollout_corr/gap{g}/{name}'
      np.testing.assert_allclose(combined[k], whole[k], rtol=1e-5, err_msg=k)
      plain = np.mean([float(m[k]) for m, _ in parts])
      differs += not np.isclose(plain, float(whole[k]), rtol=1e-3)
  assert differs > 0  # the unweighted mean would be wrong here


def test_bypass_gap_metrics_do_not_depend_on_micro_batching():
  """RLStep in bypass mode: the per-gap metrics with 2 micro-batches are
  those of 1 (token-weighted, like decoupled mode's single call)."""
  batch = rollout_batch(VERSIONS, FINISH)
  outs = [
    _rl_step('bypass_pg_is', batch, TV, 'mask', micro_batches=n) for n in (1, 2)
  ]
  for g in range(4):
    for name in GAP_MEANS:
      k = f'rollout_corr/gap{g}/{name}'
      np.testing.assert_allclose(outs[1][k], outs[0][k], rtol=1e-5, err_msg=k)
  assert outs[0]['rollout_corr/gap1/token_fraction'] > 0


# ------------------------------------------------------------- fail loud

CFG = ValidationConfig(vocab_size=27, samples_per_prompt=4)


def test_all_zero_rollout_logp_is_an_error():
  batch = rollout_batch(VERSIONS, FINISH)
  zeros = batch.replace(rollout_logp=np.zeros_like(batch.rollout_logp))
  with pytest.raises(
    ValueError,
    match=r'rollout_logp: rollout log-probs look missing \(all zeros',
  ) as e:
    validate_rollout_batch(zeros, CFG)
  assert 'the engine must return per-token log-probs' in str(e.value)
  # Greedy decoding (top_k=1) has log-prob 0 on every token: allowed.
  greedy = zeros.replace(
    top_k=np.ones(8, np.int32),
    rollout_logp_truncated=np.zeros_like(batch.rollout_logp),
  )
  validate_rollout_batch(
    greedy, ValidationConfig(27, top_k=1, samples_per_prompt=4)
  )
  # One non-zero value is a real (if very sure) engine.
  one = np.zeros_like(batch.rollout_logp)
  one[0, 0] = -1e-3
  validate_rollout_batch(batch.replace(rollout_logp=one), CFG)
  with pytest.raises(ValueError, match='rollout_logp: missing'):
    validate_rollout_batch(batch.replace(rollout_logp=None), CFG)


@pytest.mark.parametrize(
  ('mode', 'field'),
  [('full', 'rollout_logp'), ('truncated', 'rollout_logp_truncated')],
)
def test_assemble_never_fills_missing_logp_with_zeros(mode, field):
  batch = rollout_batch(VERSIONS, FINISH).replace(**{field: None})
  with pytest.raises(ValueError, match=rf'RolloutBatch\.{field} is None'):
    _assemble(batch, 'wait', mode=mode)


def test_version_gap_outside_bypass_mode_is_an_error():
  """The decoupled correction runs once in prepare: a gap given to the
  per-micro-batch objective would be silently unused."""
  c = pulse_config('decoupled_token_is')
  run = build.build(c)
  x = jnp.zeros((2, 3))
  with pytest.raises(ValueError, match='version_gap is for the bypass'):
    objective.actor_objective(
      run.losses.actor,
      run.losses.correction,
      logp=x,
      advantages=x,
      mask=jnp.ones((2, 3), bool),
      old_logp=x,
      version_gap=jnp.zeros((2, 3), jnp.int32),
    )


def test_a_run_of_batches_with_nothing_left_warns_then_stops(caplog):
  """`RLStep` with 'drop' on batches whose every row is staler than the
  bound: each is a warning naming the settings to change, and one more
  than `rollout.max_empty_batches` (2) in a row stops the run; a batch
  with tokens in between starts the count afresh."""
  c = pulse_config(
    'decoupled_token_is',
    rollout__mode='stream',
    rollout__max_staleness=MAX_STALE,
    rollout__staleness_policy='drop',
    rollout__samples_per_prompt=4,
  )
  run = build.build(c)
  assert run.rollout.max_empty_batches == 2
  mesh = one_device_mesh()
  state, steps = fresh_train_state(run, mesh)
  rl = RLStep(run, steps, mesh, vocab_size=run.model.vocab_size, batch_shards=1)
  stale = [[v if v < 0 else 0 for v in row] for row in VERSIONS]
  reward = np.random.default_rng(0).integers(0, 2, len(VERSIONS))

  def step(versions):
    nonlocal state  # the update donates it
    scored = Scored(
      step=TV,
      batch=rollout_batch(versions, FINISH),
      rewards=reward.astype(np.float32),
      metrics={},
    )
    state, out = rl(state, None, scored, TV)
    return out

  assert step(stale)['batch/valid_tokens'] == 0
  assert step(VERSIONS)['batch/valid_tokens'] > 0  # the count restarts
  step(stale)
  step(stale)
  warnings = [r.getMessage() for r in caplog.records]
  warnings = [w for w in warnings if 'trained on nothing' in w]
  assert len(warnings) == 3
  assert warnings[0].startswith(
    'step 6 trained on nothing: no response token left (86% of the rows '
    'dropped as staler than rollout.max_staleness=2 (rollout.staleness_'
    "policy='drop')); check rollout.staleness_policy='wait'"
  )
  with pytest.raises(
    RuntimeError,
    match=r'3 such batches in a row > rollout.max_empty_batches=2: change '
    r"rollout.staleness_policy='wait', a larger rollout.max_staleness or a "
    r'smaller rollout.queue_size',
  ):
    step(stale)


def test_an_empty_batch_of_environment_failures_names_the_environment(caplog):
  """Rows an environment failed are ABORT rows (jaxcorr/agents/failures.py):
  the empty-batch warning names the environment and agent/env_errors, not
  the engine; engine-only failures still point at the engine."""
  empty = staleness.EmptyBatches(
    limit=5, policy='wait', max_staleness=None, queue_size=1
  )
  empty.check(0, 0.0, {'rollout/finish_abort_fraction': 1.0})
  empty.check(
    1, 0.0, {'rollout/finish_abort_fraction': 1.0, 'agent/env_errors': 16.0}
  )
  engine, env = [
    r.getMessage()
    for r in caplog.records
    if 'trained on nothing' in r.getMessage()
  ]
  assert 'engine ERROR or ABORT rows' in engine and 'check the engine' in engine
  assert "16 of them the environment's failures (agent/env_errors)" in env
  assert 'check the environment' in env and 'engine' not in env
