"""The jitted device side of an RL step, apart from the host loop.

Per RL step the host calls two compiled functions:

    prepare(params, critic_params, kl_ctrl, ref_params, batch)
                                       -> kl_ctrl, batch, metrics
        jaxcorr/train/prepare.py: old/ref log-probs, values, KL in reward,
        advantages and (decoupled mode) the rollout correction, once on the
        global batch.
    update(state, batch)               -> state, metrics
        ppo_epochs x mini_batches optimizer updates in one `lax.scan`; each
        mini-batch is `micro_batches` gradient-accumulation chunks whose
        losses use *global* normalisers (objective.py's docstring): token
        counts of the whole mini-batch, not a mean of micro-batch means.
        In bypass mode the correction runs inside the loss, per micro-batch
        (docs/math/correction.md §2), with unit normalisers and one division by
        the summed corrected count at the end.

Micro-batch metrics combine by their kind (jaxcorr/train/tracker/reduction.py);
metrics of the updates are averaged over the updates. Everything here is a
pure function of arrays and the static `RunConfig`; shapes are checked at
trace time by the losses.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxcorr.losses import correction as corr_lib
from jaxcorr.losses import objective, objective_config, value
from jaxcorr.train import loss_batch, mixed_precision, scoring
from jaxcorr.train.batch import TrainBatch
from jaxcorr.train.distill import direct as distill_direct
from jaxcorr.train.distill import rules as distill_rules
from jaxcorr.train.packing import forward as packed_forward
from jaxcorr.train.packing.layout import PackedRows
from jaxcorr.train.prepare import gap_arguments, prepare
from jaxcorr.train.routing import metrics as routing_metrics
from jaxcorr.train.run_config import RunConfig
from jaxcorr.train.state import TrainState, apply_updates
from jaxcorr.train.tracker import diagnostics, reduction

# Loss terms with global normalisers: the micro-batches' values add up.
SUMMED = frozenset(
  {
    'actor/pg_loss',
    'actor/entropy',
    'actor/kl_loss',
    'actor/rollout_kl_loss',
    'actor/loss',
    'actor/loss_token_count',
    'actor/loss_seq_count',
    'critic/vf_loss',
    distill_direct.LOSS_METRIC,
  }
)
_COUNTS = ('actor/loss_token_count', 'actor/loss_seq_count')


class Steps:
  """The compiled functions of one run (static config and graphdefs).

  Args:
    run: the validated run config.
    graphdef: the policy's `nnx.GraphDef`.
    tx: the RL optimizer of the policy; schedule: its learning rate.
    critic_graphdef, critic_tx: the critic's, or None.
    state_shardings: a `TrainState` of shardings: where updated params
      must live (the shardings they were created with); None leaves it to
      XLA.
    routing: an MoE policy's (L_moe, k, E) (`moe.routing_shape`); None
      for a dense policy.
  """

  def __init__(
    self,
    run: RunConfig,
    graphdef: Any,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    *,
    critic_graphdef: Any = None,
    critic_tx: optax.GradientTransformation | None = None,
    state_shardings: Any = None,
    routing: tuple[int, int, int] | None = None,
  ):
    self.run, self.routing = run, routing
    self.graphdef = graphdef
    self.tx = tx
    self.schedule = schedule
    self.critic_graphdef = critic_graphdef
    self.critic_tx = critic_tx
    self.state_shardings = state_shardings
    # Times each function was traced (a Python side effect runs only while
    # tracing): a step that retraces recompiles, which tests rule out.
    self.traces = {'prepare': 0, 'update': 0}
    # prepare donates nothing: the params it reads are the ones the update
    # trains next (and, in sync mode, the engine's until the weight sync).
    # `light` (static): train.metrics_every's steps without diagnostics.
    self.prepare = jax.jit(
      self._prepare,
      static_argnames='light',
      out_shardings=None
      if state_shardings is None
      else (state_shardings.kl_ctrl, None, None),
    )
    # The updated state keeps the input's shardings, so the next step's
    # call hits the same compiled executable.
    out = None
    if state_shardings is not None:
      out = (state_shardings.replace(frozen=None), None)
    if state_shardings is not None and state_shardings.frozen is not None:
      self.update = _frozen_apart(self._update, out)
    else:
      self.update = jax.jit(
        self._update,
        donate_argnums=(0,),
        static_argnames='light',
        out_shardings=out,
      )

  def _prepare(
    self,
    params: Any,
    critic_params: Any,
    kl_ctrl: Any,
    ref_params: Any,
    batch: TrainBatch,
    packed: PackedRows | None = None,
    light: bool = False,
    teacher: Any = None,
  ):
    self.traces['prepare'] += 1
    kl_ctrl, batch, metrics = prepare(
      self.run,
      self.graphdef,
      self.critic_graphdef,
      params,
      critic_params,
      kl_ctrl,
      ref_params,
      batch,
      packed,
      teacher,
    )
    return kl_ctrl, batch, diagnostics.light(metrics) if light else metrics

  # ------------------------------------------------------------- update

  def _critic_loss(self, critic_params, mic: TrainBatch, counts, micro=None):
    v = packed_forward.critic_values(
      self.critic_graphdef, critic_params, mic, micro
    )
    return value.value_loss(
      v,
      mic.values,
      mic.returns,
      mic.response_mask,
      cliprange_value=self.run.critic.cliprange_value,
      agg=self.run.critic.agg,
      num_tokens=counts[0],
      num_seqs=counts[1],
      norm=self.run.rollout.max_new_tokens,
    )

  def _micro_step(
    self, state, counts, critic_counts, key, mb, light, carry, xs
  ):
    """One micro-batch: its gradients added to the carry, its metrics.
    `xs`: (its rows, or with packing its `PackedRows` of the mini-batch
    `mb`; its index); `light`: a step without heavy diagnostics."""
    g_acc, cg_acc = carry
    mic, i = xs
    micro = None
    if isinstance(mic, PackedRows):
      micro, mic = mic, packed_forward.micro_view(mb, mic.member)
    actor_loss = functools.partial(
      _actor_loss,
      self.run,
      self.graphdef,
      entropy=needs_entropy(self.run, light),
    )
    actor_grad = jax.value_and_grad(actor_loss, has_aux=True)
    (loss, (met, gap_weights)), g = actor_grad(
      state.params,
      mic,
      counts,
      jax.random.fold_in(key, i),
      micro,
      state.frozen,
    )
    met = dict(met, **{'actor/loss': loss})
    g_acc = mixed_precision.accumulate(g_acc, g)
    if self.run.critic.enabled:
      critic_grad = jax.value_and_grad(self._critic_loss, has_aux=True)
      (_, cmet), cg = critic_grad(
        state.critic_params, mic, critic_counts, micro
      )
      cg_acc = mixed_precision.accumulate(cg_acc, cg)
      met.update(cmet)
    typed = reduction.from_loss(met, summed=SUMMED)
    # Bypass mode's per-gap means weigh by their tokens, so the micro-batches
    # combine to the value of one call on the mini-batch (decoupled mode
    # computes them once, on the whole batch, in prepare).
    for k, w in gap_weights.items():
      typed[k] = reduction.Metric.wavg(met[k], w)
    return (g_acc, cg_acc), typed

  def _minibatch_grads(
    self, state: TrainState, mb: TrainBatch, key, micros=None, light=False
  ):
    """Summed micro-batch gradients with global normalisers (`micros`: the
    mini-batch's `PackedRows` with packing)."""
    run = self.run
    n = run.train.micro_batches
    unit = not run.decoupled  # bypass: the mask is known only per micro
    if unit:
      counts = (jnp.float32(1), jnp.float32(1))
    else:
      m = mb.response_mask
      if mb.corr_mask is not None:
        m = m & mb.corr_mask
      counts = objective.loss_normalizers(m)
    critic_counts = objective.loss_normalizers(mb.response_mask)
    zeros = mixed_precision.grad_accumulator  # float32 sums
    init = (
      zeros(state.params),
      zeros(state.critic_params) if run.critic.enabled else None,
    )
    body = functools.partial(
      self._micro_step, state, counts, critic_counts, key, mb, light
    )
    parts = scoring.split_micro(mb, n) if micros is None else micros
    (grads, cgrads), met = jax.lax.scan(body, init, (parts, jnp.arange(n)))
    metrics = reduction.values(reduction.reduce_parts(met))
    if unit:
      kind = objective_config.normalizer_kind(run.losses.actor)
      if kind != 'none':
        count = _COUNTS[0] if kind == 'tokens' else _COUNTS[1]
        denom = jnp.maximum(metrics[count], 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        for k in SUMMED - set(_COUNTS):
          if k in metrics and not k.startswith('critic/'):
            metrics[k] = metrics[k] / denom
    return grads, cgrads, metrics

  def _one_update(
    self, batch: TrainBatch, key, packed, frozen, light, state, xs
  ):
    """One optimizer update on the mini-batch of rows `idx` (with packing:
    on mini-batch number `idx`; `frozen`: the LoRA base, read here but kept
    out of the scan's carry)."""
    idx, i = xs
    state = state.replace(frozen=frozen)
    shard = self.state_shardings
    sub, micros = packed_forward.minibatch(batch, packed, idx)
    grads, cgrads, metrics = self._minibatch_grads(
      state, sub, jax.random.fold_in(key, 1000 + i), micros, light
    )
    metrics['actor/grad_norm'] = optax.tree.norm(grads)
    metrics['actor/lr'] = self.schedule(state.updates)
    scale = loss_batch.step_scale(self.run, sub, metrics)
    params, opt_state = apply_updates(
      self.tx,
      grads,
      state.opt_state,
      state.params,
      None if shard is None else shard.params,
      scale=scale,
    )
    state = state.replace(
      params=params, opt_state=opt_state, updates=state.updates + 1
    )
    if self.run.critic.enabled:
      metrics['critic/grad_norm'] = optax.tree.norm(cgrads)
      cparams, copt = apply_updates(
        self.critic_tx,
        cgrads,
        state.critic_opt_state,
        state.critic_params,
        None if shard is None else shard.critic_params,
      )
      state = state.replace(critic_params=cparams, critic_opt_state=copt)
    return state.replace(frozen=None), metrics

  def _update(
    self,
    state: TrainState,
    batch: TrainBatch,
    packed: PackedRows | None = None,
    light: bool = False,
  ):
    self.traces['update'] += 1
    rng, key = jax.random.split(state.rng)
    order = update_order(self.run.train, batch.rows, key, packed is not None)
    steps = jnp.arange(order.shape[0])
    frozen = state.frozen  # read by every update, not carried by the loop
    row_logp = functools.partial(_row_logp, self.run, self.graphdef, frozen)
    batch, shaped = loss_batch.for_update(self.run, batch, row_logp, key, state)
    body = functools.partial(
      self._one_update, batch, key, packed, frozen, light
    )
    state, metrics = jax.lax.scan(
      body, state.replace(frozen=None), (order, steps)
    )
    metrics = jax.tree.map(jnp.mean, metrics)
    metrics['actor/updates'] = jnp.asarray(order.shape[0], jnp.float32)
    metrics.update(shaped)
    if light:
      metrics = diagnostics.light(metrics)
    return state.replace(rng=rng, frozen=frozen), metrics


def _row_logp(run, graphdef, frozen, key, params, row: TrainBatch):
  """Σ_t m_t log π_θ(y_t) of a one-row batch: what VCPO's exact score
  norms differentiate (`loss_batch.score_sq_norms`)."""
  if frozen is not None:  # LoRA: the adapters' gradient
    params = nnx.merge_state(frozen, params)
  (logp, _), _, _ = _update_forward(
    run, graphdef, params, row, None, key, False
  )
  return jnp.sum(jnp.where(row.response_mask, logp, 0.0))


def needs_entropy(run: RunConfig, light: bool) -> bool:
  """Whether the update computes π_θ's entropy over the vocabulary: when
  the loss uses it (`actor.entropy_coeff` != 0) or the step logs it (not
  `light`). It is a diagnostic otherwise, and costs 5.9% of SmolLM2's
  update on the CPU (docs/benchmarks.md, "GPU: one NVIDIA H200, second
  run")."""
  return run.losses.actor.entropy_coeff != 0 or not light


def _actor_loss(
  run: RunConfig,
  graphdef: Any,
  params,
  mic: TrainBatch,
  counts,
  key,
  micro=None,
  frozen=None,
  *,
  entropy: bool = True,
):
  """The actor objective of one micro-batch (`jaxcorr.losses.objective`)
  with the MoE balance terms: (loss, (metrics, bypass gap-metric
  weights)); without `entropy` no `actor/entropy` (`needs_entropy`)."""
  corr = run.losses.correction
  if frozen is not None:  # LoRA: differentiate the adapters only
    params = nnx.merge_state(frozen, params)
  (logp, ent), routing, topk = _update_forward(
    run, graphdef, params, mic, micro, key, entropy
  )
  correction, gap, gap_weights = None, {}, {}
  if run.decoupled and corr is not None:
    correction = corr_lib.Correction(mic.corr_weights, mic.corr_mask, {})
  elif not run.decoupled:
    gap = gap_arguments(run, mic.version_gap)
  if gap:
    gap_weights = corr_lib.gap_metric_weights(
      jax.lax.stop_gradient(logp), mic.rollout_logp, mic.response_mask, **gap
    )
  loss, metrics = objective.actor_objective(
    run.losses.actor,
    corr,
    logp=logp,
    advantages=mic.advantages,
    mask=mic.response_mask,
    old_logp=mic.old_logp if run.decoupled else None,
    rollout_logp=mic.rollout_logp,
    ref_logp=mic.ref_logp,
    entropy=ent,
    correction=correction,
    num_tokens=counts[0],
    num_seqs=counts[1],
    norm=run.rollout.max_new_tokens,
    key=key,
    **gap,
    seq_reward=mic.seq_reward,
  )
  if routing is not None:
    term, met = routing_metrics.step_terms(routing, mic, counts, run.moe)
    loss, metrics = loss + term, dict(metrics, **met)
    tokens = jnp.sum(mic.segment_ids != 0, dtype=jnp.float32)
    gap_weights = dict(gap_weights, **dict.fromkeys(met, tokens))
  if distill_rules.is_direct(run):  # a direct distillation term
    term, met, w = distill_direct.update_term(run, mic, logp, topk, counts)
    loss, metrics = loss + term, dict(metrics, **met)
    gap_weights = dict(gap_weights, **w)
  return loss, (metrics, gap_weights)


def _update_forward(
  run, graphdef, params, mic: TrainBatch, micro, key, entropy: bool
):
  """The update's forward of one micro-batch: ((log-probs, entropy or
  None) `[rows, T]`, the MoE layers' `RouterStats` or None, the student's
  log-probs at the teacher's top-k ids or None), with LoRA dropout when
  `lora.dropout` is set; with packing (`micro`, dense policies only) over
  its packed rows."""
  dropout = jax.random.fold_in(key, 7) if run.lora.dropout else None
  if distill_rules.needs_topk(run):  # one forward, the full softmax
    out, topk = distill_direct.student_forward(
      run, graphdef, params, mic, entropy=entropy, dropout_key=dropout
    )
    return out, None, topk
  if micro is not None:
    out = packed_forward.policy_logp(
      run, graphdef, params, mic, micro, entropy=entropy, dropout_key=dropout
    )
    stats = None
  else:
    out, stats = scoring.response_logp(
      run,
      graphdef,
      params,
      mic,
      entropy=entropy,
      routing=True,
      dropout_key=dropout,
    )
  return (out if entropy else (out, None)), stats, None


def update_order(t: Any, rows: int, key: jax.Array, packed: bool):
  """The rows of each update, `[epochs x mini_batches, rows/mini_batches]`
  (`t`: `TrainConfig`). With packing the host fixed each mini-batch's rows
  (shuffled there): `[epochs x mini_batches]` mini-batch numbers, each
  epoch visiting the mini-batches in a shuffled order."""
  rows = t.mini_batches if packed else rows
  mb = rows // t.mini_batches
  order = []
  for e in range(t.ppo_epochs):
    if t.shuffle_minibatches:
      perm = jax.random.permutation(jax.random.fold_in(key, e), rows)
    else:
      perm = jnp.arange(rows)
    order.append(perm.reshape(t.mini_batches, mb))
  order = jnp.concatenate(order, 0)
  return order[:, 0] if packed else order


def _frozen_apart(update, out_shardings):
  """A LoRA run's `Steps.update`: the frozen base is an argument of the
  compiled step that is neither donated nor returned (nor carried by its
  loop, `Steps._update`), so no step ever copies it."""

  def inner(state, frozen, batch, packed=None, light=False):
    state, metrics = update(state.replace(frozen=frozen), batch, packed, light)
    return state.replace(frozen=None), metrics

  jitted = jax.jit(
    inner,
    donate_argnums=(0,),
    static_argnames='light',
    out_shardings=out_shardings,
  )

  def call(state: TrainState, batch: TrainBatch, packed=None, light=False):
    new, metrics = jitted(
      state.replace(frozen=None), state.frozen, batch, packed, light=light
    )
    return new.replace(frozen=state.frozen), metrics

  call._cache_size = jitted._cache_size  # what tests read of a jit
  return call
