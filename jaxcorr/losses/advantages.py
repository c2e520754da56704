"""Advantage estimators (docs/math/advantages.md §2–§4): registry and group
math.

`compute_advantages(estimator, token_rewards, mask, group_ids, ...)` returns
`(advantages, returns)`, both float `[B, T]`, exactly 0 outside `mask` (D13)
and without gradient. With `s_i = Σ_t r·m` (valid tokens only, D6),
`v_i = [n_i > 0]` and, over the valid members of group g,
`c_g = Σ v`, `μ_g = Σ v·s / c_g`, `σ_g` the unbiased (two-pass) std, a
singleton group (c_g = 1) using μ = 0, σ = 1:

============================  =====================================================
estimator                     sequence advantage `a_i` (broadcast as `a_i·m`)
============================  =====================================================
gae                           `whiten(G, m)`, G from masked GAE; returns `(G+V)·m`
grpo                          `(s_i − μ_g)/(σ_g + eps)`, or `s_i − μ_g` (no std)
rloo                          `(s_i − μ_g)·c_g/(c_g − 1)`; a singleton keeps `s_i`
reinforce_plus_plus           `whiten(R, m)`, `R_t = r_t + γ·R_{t+1}`; returns R
reinforce_plus_plus_baseline  `whiten((s_i − μ_g)·m, m)`
remax                         `(R_t − b_i)·m`, `R_t = Σ_{t'≥t} r·m`; returns `R·m`
opo                           `s_i − Σ_g n_j·s_j / Σ_g n_j`; singleton baseline 0
gpg                           `α·(s_i − μ_g)`, `α = |V| / max(#{V: s ≠ 0}, 1)`
grpo_passk                    group best row only: `s_max − s_2nd` (/ `σ_g + eps`)
maxrl                         `(s_i − μ_g)/(μ_g + eps)`; a singleton keeps `s_i`
============================  =====================================================

The group estimators return `returns = advantages`. Dr.GRPO is `grpo` with
`norm_adv_by_std=False` plus the `seq_mean_token_sum_norm` aggregation.

Group statistics are `jax.ops.segment_sum` / `segment_max` / `segment_min`
over `group_ids` with `num_segments=B` (static): no Python loop over groups,
one compilation per shape, and the same result whether a group's rows are
adjacent or not. Empty rows are not group members (D12). The token
recursions (gae, reinforce_plus_plus, remax) are in `advantages_scan`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcorr.config.fields import (
  boolean,
  is_number,
  number,
  one_of,
  setting,
  validate,
)
from jaxcorr.losses import advantages_scan as scan
from jaxcorr.losses import masked

ESTIMATORS = (
  'gae',
  'grpo',
  'rloo',
  'reinforce_plus_plus',
  'reinforce_plus_plus_baseline',
  'remax',
  'opo',
  'gpg',
  'grpo_passk',
  'maxrl',
)
NEEDS_GROUPS = frozenset(ESTIMATORS) - {'gae', 'reinforce_plus_plus', 'remax'}
"""Estimators that read `group_ids` (the others accept None)."""


# ------------------------------------------------------------------ config


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  """Which estimator and its knobs (docs/math/advantages.md §2); frozen,
  hashable, validated.

  `'grpo'` is the SkyRL and slime default (verl defaults to `'gae'`).
  """

  estimator: str = setting(
    'grpo',
    one_of(*ESTIMATORS, quote=False),
    'Advantage estimator: ' + ', '.join(ESTIMATORS) + '.',
  )
  gamma: float = setting(
    1.0, number(0, 1), 'Discount γ in [0, 1] (gae, reinforce_plus_plus).'
  )
  lam: float = setting(1.0, number(0, 1), 'GAE λ in [0, 1] (gae).')
  norm_adv_by_std: bool = setting(
    True,
    boolean,
    'Divide by the group std + eps (grpo, grpo_passk); False with grpo is '
    "Dr.GRPO's advantage.",
  )
  eps: float = setting(
    1e-6,
    number(0),
    'ε >= 0 added to the group std (grpo, grpo_passk) or mean (maxrl).',
  )

  def __post_init__(self):
    validate(self)


# ---------------------------------------------------------- group statistics


class Groups(NamedTuple):
  """Per-row group statistics over valid members, each `[B]`.

  Attributes:
    score: `s_i`, the masked reward sum.
    valid: `v_i`, the row has at least one valid token.
    count: `c_g` of the row's group (valid members only).
    mean: `μ_g` of the row's group; 0 for a singleton (and an empty group).
    std: `σ_g` of the row's group (unbiased); 1 for a singleton.
    ids: the int `[B]` group ids.
  """

  score: jax.Array
  valid: jax.Array
  count: jax.Array
  mean: jax.Array
  std: jax.Array
  ids: jax.Array


def _replicated(x: jax.Array) -> tuple[jax.Array, Any]:
  """`x` replicated when it is sharded over an explicit mesh axis.

  Under an explicit-axis mesh (the `jax.make_mesh` default) a scatter with
  sharded indices has no unambiguous output sharding, so the `[B]` vectors
  of the segment ops are all-gathered first (B numbers); the result goes
  back to the rows' sharding. Without a mesh, or under automatic sharding,
  this is the identity.
  """
  sharding = jax.typeof(x).sharding
  mesh = getattr(sharding, 'mesh', None)
  if mesh is None or mesh.empty:
    return x, None
  if all(p is None for p in sharding.spec):
    return x, None
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.sharding.reshard(x, replicated), sharding


def _segment(op: Callable, x: jax.Array, ids: jax.Array) -> jax.Array:
  """Per-row `op` (segment_sum/max/min) over the row's group, `[B]`."""
  xr, sharding = _replicated(x)
  ir, _ = _replicated(ids)
  out = op(xr, ir, num_segments=x.shape[0])[ir]
  return out if sharding is None else jax.sharding.reshard(out, sharding)


def group_sum(x: jax.Array, ids: jax.Array) -> jax.Array:
  """Per-row sum of `x` over the row's group (`[B]` → `[B]`)."""
  return _segment(jax.ops.segment_sum, x, ids)


def _gmax(x: jax.Array, ids: jax.Array) -> jax.Array:
  return _segment(jax.ops.segment_max, x, ids)


def _gmin(x: jax.Array, ids: jax.Array) -> jax.Array:
  return _segment(jax.ops.segment_min, x, ids)


def group_stats(rewards: jax.Array, mask: jax.Array, ids: jax.Array) -> Groups:
  """`s`, `v`, `c_g`, `μ_g`, `σ_g` (docs/math/advantages.md §3) with segment
  sums.

  The moments are taken on the scores divided by a per-group power of two
  (`masked.range_scale` of the group's largest |s|) and scaled back: the
  same values bit for bit wherever the unscaled form is finite, and finite
  where it would overflow (`(s − μ)²` of rewards of ±1e30 in float32 is
  inf, which made every grpo advantage 0).

  Args:
    rewards: float `[B, T]`, 0 outside `mask`.
    mask: bool `[B, T]`.
    ids: int `[B]` group ids in [0, B).
  """
  dtype = rewards.dtype
  zero = jnp.zeros((), dtype)
  valid = jnp.any(mask, axis=-1)
  score = masked.row_sum(rewards, mask)
  count = group_sum(valid.astype(dtype), ids)
  scale = masked.range_scale(_gmax(jnp.where(valid, jnp.abs(score), zero), ids))
  scaled = score / scale
  mean = masked.safe_div(group_sum(jnp.where(valid, scaled, zero), ids), count)
  dev = jnp.where(valid, jnp.square(scaled - mean), zero)
  var = masked.safe_div(group_sum(dev, ids), jnp.maximum(count - 1, 0))
  multi = count > 1
  mean = jnp.where(multi, mean * scale, zero)
  std = jnp.where(multi, masked.safe_sqrt(var) * scale, jnp.ones((), dtype))
  return Groups(score, valid, count, mean, std, ids)


# ------------------------------------------------------- group estimators
# Each maps (Groups, mask, knobs) to the sequence advantage a_i `[B]`.


def grpo(g: Groups, mask: jax.Array, k: dict) -> jax.Array:
  """`(s − μ)/(σ + eps)`, or `s − μ` without std; singleton `s/(1 + eps)`."""
  del mask
  centred = g.score - g.mean
  if not k['norm_adv_by_std']:
    return centred
  return masked.safe_div(centred, g.std + k['eps'])


def rloo(g: Groups, mask: jax.Array, k: dict) -> jax.Array:
  """Leave-one-out: `(s − μ)·c/(c − 1)`; a singleton keeps `s` (verl)."""
  del mask, k
  scale = masked.safe_div(g.count, g.count - 1)
  return jnp.where(g.count > 1, (g.score - g.mean) * scale, g.score)


def reinforce_plus_plus_baseline(
  g: Groups, mask: jax.Array, k: dict
) -> jax.Array:
  """`whiten((s − μ)·m, m)`, singleton μ = 0; returns a `[B, T]` array."""
  del k
  centred = jnp.where(mask, (g.score - g.mean)[:, None], 0)
  return scan.whiten(centred, mask)


def opo(g: Groups, mask: jax.Array, k: dict) -> jax.Array:
  """`s − Σ n·s / Σ n` over the group (length-weighted); singleton 0."""
  del k
  ids = g.ids
  n = masked.row_count(mask, g.score.dtype)
  base = masked.safe_div(group_sum(n * g.score, ids), group_sum(n, ids))
  return g.score - jnp.where(g.count > 1, base, 0)


def gpg(g: Groups, mask: jax.Array, k: dict) -> jax.Array:
  """`α·(s − μ)`, `α = |V| / max(#{i ∈ V: s_i ≠ 0}, 1)` (D12: V not B)."""
  del mask, k
  dtype = g.score.dtype
  n_valid = jnp.sum(g.valid, dtype=dtype)
  n_nonzero = jnp.sum(g.valid & (g.score != 0), dtype=dtype)
  alpha = n_valid / jnp.maximum(n_nonzero, 1)
  return alpha * (g.score - g.mean)


def grpo_passk(g: Groups, mask: jax.Array, k: dict) -> jax.Array:
  """Only the group's best row gets `s_max − s_2nd` (/ `σ + eps`).

  `i*` is the lowest-index valid row attaining the group maximum; `s_2nd` is
  the maximum with `i*` excluded, so a tie gives 0. Every other row, and
  every row of a group with fewer than 2 valid members, gets 0 (D12).
  """
  del mask
  ids = g.ids
  b = g.score.shape[0]
  neg = jnp.asarray(-jnp.inf, g.score.dtype)
  s = jnp.where(g.valid, g.score, neg)
  s_max = _gmax(s, ids)
  rows = jnp.arange(b, dtype=ids.dtype)
  is_max = g.valid & (s == s_max)
  best = _gmin(jnp.where(is_max, rows, b), ids)
  is_best = rows == best
  s_2nd = _gmax(jnp.where(is_best, neg, s), ids)
  ok = is_best & (g.count > 1)
  gap = jnp.where(ok, s_max - jnp.where(ok, s_2nd, 0), 0)
  if k['norm_adv_by_std']:
    gap = masked.safe_div(gap, g.std + k['eps'])
  return jnp.where(ok, gap, 0)


def maxrl(g: Groups, mask: jax.Array, k: dict) -> jax.Array:
  """`(s − μ)/(μ + eps)`, 0 when the denominator is 0; singleton keeps `s`."""
  del mask
  rel = masked.safe_div(g.score - g.mean, g.mean + k['eps'])
  return jnp.where(g.count > 1, rel, g.score)


# ---------------------------------------------------------------- registry

GroupFn = Callable[[Groups, jax.Array, dict], jax.Array]

GROUP_ESTIMATORS: dict[str, GroupFn] = {
  'grpo': grpo,
  'rloo': rloo,
  'reinforce_plus_plus_baseline': reinforce_plus_plus_baseline,
  'opo': opo,
  'gpg': gpg,
  'grpo_passk': grpo_passk,
  'maxrl': maxrl,
}
TOKEN_ESTIMATORS = ('gae', 'reinforce_plus_plus', 'remax')
"""Estimators computed by a reverse scan over T (`advantages_scan`)."""


def _check_estimator(estimator: Any) -> str:
  if not isinstance(estimator, str) or estimator not in ESTIMATORS:
    raise ValueError(
      f'estimator={estimator!r} is not an advantage estimator; allowed: '
      + ', '.join(ESTIMATORS)
    )
  return estimator


def _check_static_unit(name: str, value: Any) -> None:
  """Range check for a Python-number γ/λ (traced values are not checked)."""
  if is_number(value) and not 0.0 <= float(value) <= 1.0:
    raise ValueError(f'{name}={value!r} is invalid; allowed: [0, 1]')


def _check_row_vector(name: str, x: Any, b: int, why: str) -> None:
  masked.require(x, name, why)
  if tuple(jnp.shape(x)) != (b,):
    raise ValueError(
      f'{name} must have shape [B] = ({b},), got {tuple(jnp.shape(x))}'
    )


def _check_inputs(
  name,
  token_rewards,
  mask,
  group_ids,
  values,
  reward_baselines,
  *,
  norm_adv_by_std,
  gamma,
  lam,
) -> None:
  """`compute_advantages`'s trace-time checks: shapes, dtypes, the inputs
  `name` requires, static knob values."""
  masked.check_mask(mask)
  masked.check_shapes(
    {'token_rewards': token_rewards, 'mask': mask, 'values': values}
  )
  if not isinstance(norm_adv_by_std, bool):
    raise ValueError(
      f'norm_adv_by_std={norm_adv_by_std!r} is invalid; allowed: True or '
      'False (a Python bool, static under jit)'
    )
  _check_static_unit('gamma', gamma)
  _check_static_unit('lam', lam)
  b = jnp.shape(mask)[0]
  if name == 'gae':
    masked.require(values, 'values', "by estimator='gae'")
  if name == 'remax':
    _check_row_vector(
      'reward_baselines', reward_baselines, b, "by estimator='remax'"
    )
  if name in NEEDS_GROUPS or group_ids is not None:
    _check_row_vector('group_ids', group_ids, b, f'by estimator={name!r}')
    ids_dtype = jnp.asarray(group_ids).dtype
    if not jnp.issubdtype(ids_dtype, jnp.integer):
      raise ValueError(
        f'group_ids must have an integer dtype (int32), got {ids_dtype}'
      )


def _token_advantages(
  name, rewards, mask, values, reward_baselines, *, gamma, lam
) -> tuple[jax.Array, jax.Array]:
  """The reverse-scan estimators (`TOKEN_ESTIMATORS`) on sanitised rewards;
  their other float inputs are sanitised here, without gradient."""
  sg = jax.lax.stop_gradient
  if name == 'gae':
    v = sg(masked.sanitize(values, mask, rewards.dtype))
    return scan.gae(rewards, mask, values=v, gamma=gamma, lam=lam)
  if name == 'reinforce_plus_plus':
    return scan.reinforce_plus_plus(rewards, mask, gamma=gamma)
  valid = jnp.any(mask, axis=-1)
  base = sg(masked.sanitize(reward_baselines, valid, rewards.dtype))
  return scan.remax(rewards, mask, reward_baselines=base)


def compute_advantages(
  estimator: str,
  token_rewards: jax.Array,
  mask: jax.Array,
  group_ids: jax.Array | None,
  *,
  values: jax.Array | None = None,
  gamma: float | jax.Array = 1.0,
  lam: float | jax.Array = 1.0,
  norm_adv_by_std: bool = True,
  reward_baselines: jax.Array | None = None,
  eps: float | jax.Array = 1e-6,
) -> tuple[jax.Array, jax.Array]:
  """Advantages and returns of one batch (docs/math/advantages.md §2).

  Runs once per step on the global batch, after reward placement and KL in
  reward, with the response mask *before* rejection (D15): a rejected
  sequence stays in its group's baseline.

  Args:
    estimator: one of `ESTIMATORS` (static).
    token_rewards: float `[B, T]` rewards, already KL-shaped if KL in reward
      is on. Only valid tokens are read (D6).
    mask: bool `[B, T]` response mask (no padding, tool output or dropped
      rows).
    group_ids: int `[B]`, dense in [0, B): the prompt's index in the batch,
      shared by all samples of one prompt. Required by the group estimators;
      may be None for gae, reinforce_plus_plus and remax.
    values: float `[B, T]` critic values; required by gae.
    gamma: discount γ (gae, reinforce_plus_plus); a Python float or a traced
      scalar.
    lam: GAE λ (gae).
    norm_adv_by_std: divide by the group std (grpo, grpo_passk); a Python
      bool (static). False with grpo is Dr.GRPO's advantage.
    reward_baselines: float `[B]` greedy-rollout rewards; required by remax.
    eps: ε added to the group std (grpo, grpo_passk) or mean (maxrl).

  Returns:
    `(advantages, returns)`, float `[B, T]` in the computation dtype (at
    least float32), exactly 0 outside `mask` (D13), without gradient.

  Raises:
    ValueError: at trace time, for an unknown estimator, a missing required
      input, a non-bool mask, mismatched shapes or a non-integer `group_ids`.
  """
  name = _check_estimator(estimator)
  _check_inputs(
    name, token_rewards, mask, group_ids, values, reward_baselines,
    norm_adv_by_std=norm_adv_by_std, gamma=gamma, lam=lam,
  )  # fmt: skip
  sg = jax.lax.stop_gradient
  dtype = masked.float_dtype(token_rewards, values)
  rewards = sg(masked.sanitize(token_rewards, mask, dtype))
  if name in TOKEN_ESTIMATORS:
    return _token_advantages(
      name, rewards, mask, values, reward_baselines, gamma=gamma, lam=lam
    )
  ids = jnp.asarray(group_ids)
  groups = group_stats(rewards, mask, ids)
  knobs = {'norm_adv_by_std': norm_adv_by_std, 'eps': eps}
  adv = GROUP_ESTIMATORS[name](groups, mask, knobs)
  if adv.ndim == 1:
    adv = jnp.where(mask, adv[:, None], jnp.zeros((), adv.dtype))
  return adv, adv


def advantages_from_config(
  cfg: AdvantageConfig,
  token_rewards: jax.Array,
  mask: jax.Array,
  group_ids: jax.Array | None,
  *,
  values: jax.Array | None = None,
  reward_baselines: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """`compute_advantages` with the estimator and knobs of `cfg` (static)."""
  return compute_advantages(
    cfg.estimator,
    token_rewards,
    mask,
    group_ids,
    values=values,
    gamma=cfg.gamma,
    lam=cfg.lam,
    norm_adv_by_std=cfg.norm_adv_by_std,
    reward_baselines=reward_baselines,
    eps=cfg.eps,
  )
