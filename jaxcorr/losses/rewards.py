"""Reward placement, KL in reward and KL controllers
(docs/math/advantages.md §6–§8).

Order within one step (docs/math/advantages.md §1): `place_at_last_token` →
`apply_kl_penalty` (optional) → `compute_advantages` → `update_kl_controller`.

* `place_at_last_token(seq_rewards, mask)` writes each sequence reward on its
  row's last valid token: the last policy token of a multi-turn response,
  never a tool-output token, for left- or right-aligned layouts alike.
* `apply_kl_penalty` shapes the token rewards, `r − β·kl`, and returns the
  raw `kl` as a separate new array. JAX arrays are immutable and nothing is
  written in place, so the logged KL can never alias the shaped reward
  (slime #2114, where `kl_coef=0` logged the reward as "KL").
* `KLControlConfig` (static) and `KLControllerState` (a pytree holding β,
  checkpointed with the trainer state): `fixed` keeps β, `adaptive` moves
  it towards `target_kl` (verl, SkyRL).
"""

from __future__ import annotations

import dataclasses
import numbers

import flax.struct
import jax
import jax.numpy as jnp

from jaxcorr.config.fields import fail, number, one_of, setting, validate
from jaxcorr.losses import kl as kl_lib
from jaxcorr.losses import masked

KL_METRIC = 'actor/reward_kl_penalty'
KL_COEF_METRIC = 'actor/reward_kl_penalty_coeff'
CONTROLLER_TYPES = ('fixed', 'adaptive')
ADAPTIVE_CLIP = 0.2
"""The adaptive controller's proportional error is clipped to ±0.2."""


# ------------------------------------------------------------ placement


def last_token_index(mask: jax.Array) -> jax.Array:
  """Index of the last True entry of each row, `[B]` int32 (0 if none)."""
  t = mask.shape[-1]
  pos = jnp.arange(t, dtype=jnp.int32)
  return jnp.max(jnp.where(mask, pos, -1), axis=-1).clip(0)


def place_at_last_token(seq_rewards: jax.Array, mask: jax.Array) -> jax.Array:
  """Token scores with `seq_rewards_i` at row i's last valid token
  (docs/math/advantages.md §6).

  Every other position is 0. A row with no valid token receives nothing
  (its reward is dropped; it is not a group member either). Per-token
  (process) rewards skip this step and are passed as token scores directly.

  Args:
    seq_rewards: float `[B]` sequence rewards.
    mask: bool `[B, T]` response mask (tool output and padding False).

  Returns:
    Float `[B, T]` token scores (at least float32), no gradient.
  """
  masked.check_mask(mask)
  if jnp.ndim(mask) != 2 or tuple(jnp.shape(seq_rewards)) != mask.shape[:1]:
    raise ValueError(
      'expected seq_rewards [B] and mask [B, T], got shapes '
      f'seq_rewards={tuple(jnp.shape(seq_rewards))}, mask={mask.shape}'
    )
  valid = jnp.any(mask, axis=-1)
  r = jax.lax.stop_gradient(masked.sanitize(seq_rewards, valid))
  pos = jnp.arange(mask.shape[-1], dtype=jnp.int32)
  at_last = (pos == last_token_index(mask)[:, None]) & valid[:, None]
  return jnp.where(at_last, r[:, None], jnp.zeros((), r.dtype))


# ---------------------------------------------------------- KL in reward


def apply_kl_penalty(
  token_scores: jax.Array,
  behaviour_logp: jax.Array,
  ref_logp: jax.Array,
  mask: jax.Array,
  kl_coef: float | jax.Array,
  *,
  estimator: str = 'kl',
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """KL in reward (verl `apply_kl_penalty`, docs/math/advantages.md §7).

  `kl = kl_penalty(behaviour_logp, ref_logp, estimator, mask=mask)` and
  `token_rewards = token_scores − kl_coef·kl`, with β from *before* this
  step's controller update. Metrics:

  * `actor/reward_kl_penalty = vmean(rmean(kl))`, the mean over non-empty
    rows of each row's mean KL (D4); also the `current_kl` of the
    controller update;
  * `actor/reward_kl_penalty_coeff = kl_coef`.

  Args:
    token_scores: float `[B, T]`, e.g. from `place_at_last_token`.
    behaviour_logp: float `[B, T]`: `old_logp` (decoupled) or
      `rollout_logp` (bypass).
    ref_logp: float `[B, T]` reference log-probs.
    mask: bool `[B, T]` response mask before rejection
      (docs/math/advantages.md §1).
    kl_coef: β ≥ 0, a traced scalar (controller state) or a Python float; a
      changing β never recompiles.
    estimator: any name of `kl.valid_names()` (static); verl's default `kl`
      (k1).

  Returns:
    `(token_rewards, kl, metrics)`: two distinct new float `[B, T]` arrays,
    0 outside `mask`, without gradient; the inputs are left untouched.
  """
  kl_lib.canonical_estimator(estimator, field='estimator')
  masked.check_mask(mask)
  masked.check_shapes(
    {
      'token_scores': token_scores,
      'behaviour_logp': behaviour_logp,
      'ref_logp': ref_logp,
      'mask': mask,
    }
  )
  if isinstance(kl_coef, numbers.Real) and not kl_coef >= 0:
    raise ValueError(f'kl_coef={kl_coef!r} is invalid; allowed: a float >= 0')
  sg = jax.lax.stop_gradient
  dtype = masked.float_dtype(token_scores, behaviour_logp, ref_logp)
  kl = sg(kl_lib.kl_penalty(behaviour_logp, ref_logp, estimator, mask=mask))
  kl = kl.astype(dtype)
  beta = sg(jnp.asarray(kl_coef, dtype))
  scores = sg(masked.sanitize(token_scores, mask, dtype))
  token_rewards = jnp.where(mask, scores - beta * kl, jnp.zeros((), dtype))
  valid = jnp.any(mask, axis=-1)
  current = masked.rows_mean(masked.row_mean(kl, mask), valid)
  metrics = {KL_METRIC: current, KL_COEF_METRIC: beta}
  return token_rewards, kl, metrics


# ------------------------------------------------------------ controllers


@dataclasses.dataclass(frozen=True)
class KLControlConfig:
  """KL-in-reward controller settings (verl `KLControlConfig`,
  docs/math/advantages.md §8)."""

  type: str = setting(
    'fixed',
    one_of(*CONTROLLER_TYPES),
    "Controller: 'fixed' (β constant) or 'adaptive' (β steered to target_kl).",
  )
  kl_coef: float = setting(
    0.001, number(0), 'Initial β >= 0 of token_rewards = scores − β·kl.'
  )
  target_kl: float = setting(
    0.1, number(0), 'adaptive: the per-token KL to steer to (> 0).'
  )
  horizon: int = setting(
    10000,
    number(0, allowed='a number >= 0'),
    'adaptive: sequences over which β moves by up to a factor e^{±0.2} '
    '(> 0; at start-up 0.2·batch_size/horizon must stay below 1).',
  )

  def __post_init__(self):
    path = validate(self)
    if self.type == 'adaptive':
      for name in ('target_kl', 'horizon'):
        if getattr(self, name) == 0:
          fail(f'{path}.{name}', getattr(self, name), 'a number > 0')


@flax.struct.dataclass
class KLControllerState:
  """The controller's β, a float32 scalar pytree leaf (checkpointed)."""

  coef: jax.Array


def init_kl_controller(cfg: KLControlConfig) -> KLControllerState:
  """`KLControllerState(coef=cfg.kl_coef)` as a float32 scalar."""
  return KLControllerState(coef=jnp.asarray(cfg.kl_coef, jnp.float32))


def update_kl_controller(
  state: KLControllerState,
  current_kl: jax.Array | float,
  n_steps: int | jax.Array,
  cfg: KLControlConfig,
) -> KLControllerState:
  """One controller step after the advantages (pure, jit-able).

  * `fixed`: the state unchanged.
  * `adaptive`: `e = clip(current_kl/target_kl − 1, −0.2, 0.2)`,
    `coef ← coef·(1 + e·n_steps/horizon)` (verl, SkyRL).

  Args:
    state: the current β.
    current_kl: `actor/reward_kl_penalty` of this step.
    n_steps: the number of sequences in the batch.
    cfg: the static controller config.
  """
  if cfg.type == 'fixed':
    return state
  coef = jnp.asarray(state.coef)
  dtype = coef.dtype
  err = jnp.clip(
    jnp.asarray(current_kl, dtype) / cfg.target_kl - 1,
    -ADAPTIVE_CLIP,
    ADAPTIVE_CLIP,
  )
  mult = 1 + err * jnp.asarray(n_steps, dtype) / cfg.horizon
  return state.replace(coef=coef * mult)


def check_kl_horizon(
  cfg: KLControlConfig, batch_size: int, path: str = 'KLControlConfig'
) -> None:
  """Start-up check: `0.2·batch_size/horizon < 1` keeps the factor > 0;
  `path` names the section in the error."""
  if cfg.type != 'adaptive':
    return
  if not ADAPTIVE_CLIP * batch_size / cfg.horizon < 1:
    raise ValueError(
      f'{path}.horizon: invalid value {cfg.horizon!r} for '
      f'batch_size={batch_size} (0.2*batch_size/horizon = '
      f'{ADAPTIVE_CLIP * batch_size / cfg.horizon:g}); allowed: horizon > '
      f'{ADAPTIVE_CLIP * batch_size:g}'
    )
