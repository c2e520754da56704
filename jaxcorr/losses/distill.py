"""On-policy distillation: a teacher's log-probs as a loss or a reward
(docs/distillation.md).

Notation: `s` the student's log-prob of the sampled token (`[B, T]`), `t`
the teacher's, `m` the bool response mask; per-vocabulary inputs are
`[B, T, V]` (or `[B, T, K]` on a top-k support). Every function zeroes
padding at its inputs (`where(m, x, 0)`) before any arithmetic, so junk
(NaN included) outside `m` reaches neither the value nor the gradient.

=======================  ===================================================
function                 value
=======================  ===================================================
reverse_kl_advantage     `A'_t = A_t − c·sg(k(s_t, t_t))` (dense reward; the
                         policy losses of losses/policy train on it)
reverse_kl_loss          `agg_t k(s_t, t_t)` (a direct loss; verl `k1`/`k3`)
topk_kl                  `agg_t max(0, Σ_k p(log p − log q))` on a top-k
                         support, no renormalisation (verl `*_kl_topk`)
generalized_jsd          `Σ_t m·JSD_β(t‖s)_t / Σ m` (TRL GKD)
with_rest                a top-k support plus the rest of the mass (K + 1)
teacher_gap_metrics      `teacher_corr/*`: the teacher's engine/trainer gap
=======================  ===================================================

`k` is `losses.kl.kl_penalty`'s estimator: k1 `s − t`, k3
`exp(t − s) − (t − s) − 1` (clipped like verl's `low_var_kl`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxcorr.losses import aggregate as agg_lib
from jaxcorr.losses import kl as kl_lib
from jaxcorr.losses import masked
from jaxcorr.losses.correction import metrics as corr_metrics

Metrics = dict[str, jax.Array]
ESTIMATORS = ('k1', 'k3')
TOPK_DIRECTIONS = ('forward', 'reverse')
TEACHER_GAP_PREFIX = 'teacher_corr/'
# verl's `clamp_log_probs`: top-k log-probs below log(1e-8) are raised to it
# (a masked top-k entry is −inf; −inf − −inf would be NaN).
_TOPK_LOG_FLOOR = math.log(1e-8)
# `with_rest`: an empty rest of the vocabulary as a finite log-prob.
_REST_FLOOR = 1e-30


def _estimator(name: str) -> str:
  out = kl_lib.canonical_estimator(name, 'distill.estimator')
  if out not in ESTIMATORS:
    raise ValueError(
      f'distill.estimator={name!r} is not a reverse-KL estimator; allowed: '
      + ', '.join(ESTIMATORS)
    )
  return out


def per_token_reverse_kl(
  student_logp: jax.Array,
  teacher_logp: jax.Array,
  mask: jax.Array,
  estimator: str = 'k1',
) -> jax.Array:
  """`[B, T]` single-sample estimate of KL(π_student ‖ π_teacher) at each
  sampled token, 0 outside `mask`; the teacher is a constant."""
  return kl_lib.kl_penalty(
    student_logp, teacher_logp, _estimator(estimator), mask=mask
  )


def _kl_metrics(kl: jax.Array, s, t, mask) -> Metrics:
  return {
    'distill/reverse_kl': masked.masked_mean(kl, mask),
    'distill/reverse_kl_max': masked.masked_max(kl, mask),
    'distill/student_logp': masked.masked_mean(s, mask),
    'distill/teacher_logp': masked.masked_mean(t, mask),
  }


@functools.partial(jax.jit, static_argnames=('estimator',))
def reverse_kl_advantage(
  student_logp: jax.Array,
  teacher_logp: jax.Array,
  mask: jax.Array,
  advantages: jax.Array | None = None,
  coef: float | jax.Array = 1.0,
  *,
  estimator: str = 'k1',
) -> tuple[jax.Array, Metrics]:
  """The per-token reverse KL as a dense advantage.

      A'_t = A_t − coef · sg(k(s_t, t_t))        (0 outside m)

  `s` is the *behaviour* student's log-prob (π_old, or μ in bypass mode),
  so the reward is fixed before the update and the policy losses (with
  their μ/π correction and async modes) train on `A'` unchanged. With
  `advantages=None` (A = 0) this is pure on-policy distillation (verl
  `use_kl_as_reward`, Thinking Machines' OPD); with the task advantages it
  is slime's `--use-opd` (`A − opd_kl_coef·(s − t)`), i.e. RL plus a
  weighted KL-to-teacher reward.
  """
  dtype = masked.float_dtype(student_logp, teacher_logp)
  s = masked.sanitize(jax.lax.stop_gradient(student_logp), mask, dtype)
  t = masked.sanitize(jax.lax.stop_gradient(teacher_logp), mask, dtype)
  kl = per_token_reverse_kl(s, t, mask, estimator)
  base = (
    jnp.zeros_like(s)
    if advantages is None
    else masked.sanitize(advantages, mask, dtype)
  )
  adv = jnp.where(mask, base - jnp.asarray(coef, dtype) * kl, 0.0)
  return adv, _kl_metrics(kl, s, t, mask)


@functools.partial(jax.jit, static_argnames=('estimator', 'agg'))
def reverse_kl_loss(
  student_logp: jax.Array,
  teacher_logp: jax.Array,
  mask: jax.Array,
  loss_clamp: float | None = None,
  *,
  estimator: str = 'k1',
  agg: str = 'token_mean',
) -> tuple[jax.Array, Metrics]:
  """Reverse KL as a direct loss on the current student's log-probs:

      L = agg_t min(k(s_t, t_t), loss_clamp)

  (verl `distillation.loss_mode` `k1`/`k3`, `use_policy_loss=False`). The
  gradient flows through `s` only. k1's pathwise gradient is 0 in
  expectation over student samples; prefer `reverse_kl_advantage` (k1 as a
  reward) or k3, whose gradient is that of the forward KL.
  """
  dtype = masked.float_dtype(student_logp, teacher_logp)
  s = masked.sanitize(student_logp, mask, dtype)
  t = masked.sanitize(jax.lax.stop_gradient(teacher_logp), mask, dtype)
  kl = per_token_reverse_kl(s, t, mask, estimator)
  metrics = _kl_metrics(jax.lax.stop_gradient(kl), s, t, mask)
  if loss_clamp is not None:
    kl = jnp.minimum(kl, loss_clamp)
  return agg_lib.aggregate(kl, mask, agg), metrics


def topk_logp(full_logp: jax.Array, indices: jax.Array) -> jax.Array:
  """`[B, T, K]` log-probs of `full_logp` `[B, T, V]` at `indices`: the
  student's values on the teacher's (and its own) top-k support."""
  return jnp.take_along_axis(full_logp, indices, axis=-1)


@functools.partial(jax.jit, static_argnames=('direction', 'agg'))
def topk_kl(
  student_topk_logp: jax.Array,
  teacher_topk_logp: jax.Array,
  mask: jax.Array,
  loss_clamp: float | None = None,
  *,
  direction: str = 'forward',
  agg: str = 'token_mean',
) -> tuple[jax.Array, Metrics]:
  """Forward (or reverse) KL on a shared top-k support, verl's choice:

      q̂ = max(s_k, log 1e-8),  p̂ = max(t_k, log 1e-8)
      forward_t = Σ_k e^{p̂}(p̂ − q̂)     reverse_t = Σ_k e^{q̂}(q̂ − p̂)
      L = agg_t max(0, min(·_t, loss_clamp))

  The k entries are *not* renormalised: neither distribution sums to 1 on
  the support, so the sum can be negative and is clamped at 0 (verl's
  `clamp_min(0)`). `student_topk_logp` holds the full-softmax student
  log-probs at the same indices as the teacher's (`topk_logp`; verl uses
  the union of both top-k sets, 2k entries). Metrics: the probability mass
  each side has on the support (`distill/{student,teacher}_mass`).
  """
  if direction not in TOPK_DIRECTIONS:
    raise ValueError(
      f'distill.topk_direction={direction!r}; allowed: '
      + ', '.join(TOPK_DIRECTIONS)
    )
  dtype = masked.float_dtype(student_topk_logp, teacher_topk_logp)
  m3 = mask[..., None]
  q = masked.sanitize(student_topk_logp, m3, dtype)
  p = masked.sanitize(jax.lax.stop_gradient(teacher_topk_logp), m3, dtype)
  q_hat, p_hat = (
    jnp.maximum(q, _TOPK_LOG_FLOOR),
    jnp.maximum(p, _TOPK_LOG_FLOOR),
  )
  if direction == 'forward':
    per = jnp.sum(jnp.exp(p_hat) * (p_hat - q_hat), axis=-1)
  else:
    per = jnp.sum(jnp.exp(q_hat) * (q_hat - p_hat), axis=-1)
  metrics = {
    'distill/topk_kl': masked.masked_mean(jax.lax.stop_gradient(per), mask),
    'distill/student_mass': masked.masked_mean(
      jax.lax.stop_gradient(jnp.sum(jnp.exp(q), -1)), mask
    ),
    'distill/teacher_mass': masked.masked_mean(jnp.sum(jnp.exp(p), -1), mask),
  }
  if loss_clamp is not None:
    per = jnp.minimum(per, loss_clamp)
  per = jnp.maximum(per, 0.0)
  return agg_lib.aggregate(per, mask, agg), metrics


def with_rest(
  topk_logp: jax.Array, rest_logp: jax.Array | None = None
) -> jax.Array:
  """`[..., K]` log-probs on a top-k support -> `[..., K + 1]`: the K
  entries and the rest of the mass, `log(1 − Σ_k e^{l_k})` (or
  `rest_logp`, `[...]`, where the caller has it exactly: the student's
  logsumexp off the support), floored at log 1e-30 so an empty rest stays
  finite. A distribution on K + 1 categories: a divergence of two of them
  is at most the full-vocabulary one (data processing) and equal when the
  rest is empty. The 1 − Σ form cancels near full mass; its gradient is
  for constants (the teacher), not for a trained side."""
  if rest_logp is None:
    mass = jnp.sum(jnp.exp(topk_logp), axis=-1)
    rest_logp = jnp.log(jnp.maximum(1.0 - mass, _REST_FLOOR))
  rest = jnp.maximum(rest_logp, math.log(_REST_FLOOR))
  return jnp.concatenate([topk_logp, rest[..., None]], axis=-1)


def _kl_rows(log_target: jax.Array, log_input: jax.Array) -> jax.Array:
  """`Σ_v e^{target}(target − input)`: torch's `kl_div(input, target,
  log_target=True)` summed over the vocabulary, i.e. KL(target ‖ input)."""
  return jnp.sum(jnp.exp(log_target) * (log_target - log_input), axis=-1)


@functools.partial(jax.jit, static_argnames=('beta', 'temperature'))
def generalized_jsd(
  student_logits: jax.Array,
  teacher_logits: jax.Array,
  mask: jax.Array,
  *,
  beta: float = 0.5,
  temperature: float = 1.0,
) -> tuple[jax.Array, Metrics]:
  """GKD's generalised Jensen-Shannon divergence (TRL
  `GKDTrainer.generalized_jsd_loss`, `reduction='batchmean'` with labels):

      log s = log_softmax(z_s/τ),  log t = log_softmax(z_t/τ)
      β = 0:  JSD = KL(t ‖ s)           (forward KL)
      β = 1:  JSD = KL(s ‖ t)           (reverse KL)
      else:   log M = logsumexp(log s + log(1−β), log t + log β)
              JSD = β·KL(t ‖ M) + (1−β)·KL(s ‖ M)
      L = Σ_t m·JSD_t / max(Σ m, 1)

  `beta` is static so the two end points are TRL's exact special cases
  (its mixture form is not finite at β ∈ {0, 1}). Padding logits are
  zeroed (a uniform row) before the softmax.
  """
  if not 0.0 <= beta <= 1.0:
    raise ValueError(f'distill.beta={beta!r}; allowed: a number in [0, 1]')
  dtype = masked.float_dtype(student_logits, teacher_logits)
  m3 = mask[..., None]
  zs = masked.sanitize(student_logits, m3, dtype) / temperature
  zt = masked.sanitize(jax.lax.stop_gradient(teacher_logits), m3, dtype)
  log_s = jax.nn.log_softmax(zs, axis=-1)
  log_t = jax.nn.log_softmax(zt / temperature, axis=-1)
  if beta == 0.0:
    jsd = _kl_rows(log_t, log_s)
  elif beta == 1.0:
    jsd = _kl_rows(log_s, log_t)
  else:
    log_m = jnp.logaddexp(log_s + math.log1p(-beta), log_t + math.log(beta))
    jsd = beta * _kl_rows(log_t, log_m) + (1 - beta) * _kl_rows(log_s, log_m)
  jsd = jnp.where(mask, jsd, 0.0)
  loss = masked.safe_div(jnp.sum(jsd), masked.count(mask, dtype))
  return loss, {'distill/jsd': jax.lax.stop_gradient(loss)}


def gkd_on_policy(key: jax.Array, lmbda: float) -> jax.Array:
  """Whether this step's batch is the student's own samples (TRL's
  `random.random() <= lmbda`: λ is the on-policy, student-data fraction;
  otherwise the batch is the dataset's completions)."""
  return jax.random.uniform(key) <= lmbda


def teacher_gap_metrics(
  trainer_logp: jax.Array, engine_logp: jax.Array, mask: jax.Array
) -> Metrics:
  """The teacher's own engine/trainer mismatch, as `rollout_corr/`'s
  always-emitted statistics (`correction.metrics.offpolicy_metrics`) under
  `teacher_corr/`: `kl = mean(engine − trainer)`, `k3_kl`, the perplexity
  differences and χ² of `r = trainer − engine` on the sampled tokens."""
  dtype = masked.float_dtype(trainer_logp, engine_logp)
  train = masked.sanitize(jax.lax.stop_gradient(trainer_logp), mask, dtype)
  engine = masked.sanitize(jax.lax.stop_gradient(engine_logp), mask, dtype)
  r = train - engine
  n = masked.row_count(mask, dtype)
  s = masked.row_sum_pairwise(r, mask)
  out = corr_metrics.offpolicy_metrics(train, engine, r, s, mask, n)
  return {TEACHER_GAP_PREFIX + k: v for k, v in sorted(out.items())}


def select_teacher(teacher_logps: jax.Array, teacher_ids: jax.Array):
  """Multi-teacher (MOPD): row `b` takes teacher `teacher_ids[b]`'s
  log-probs from the stacked `[K, B, T]` `teacher_logps`."""
  return jnp.take_along_axis(
    teacher_logps, teacher_ids[None, :, None].astype(jnp.int32), axis=0
  )[0]
