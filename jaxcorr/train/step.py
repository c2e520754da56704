"""The jitted device side of a training step, apart from the host loop.

Per RL step the host calls two compiled functions:

    prepare(params, critic_params, kl_ctrl, ref_params, batch)
                                       -> kl_ctrl, arrays, metrics
        old log-probs (decoupled: the trainer's forward pass with the
        pre-update params; bypass: skipped), reference log-probs when a
        ref-KL is configured, critic values, rewards on the last token,
        KL in reward (+ controller step), advantages, and in decoupled mode
        the rollout correction, once on the global batch.
    update(state, arrays)              -> state, metrics
        ppo_epochs x mini_batches optimizer updates in one `lax.scan`; each
        mini-batch is `micro_batches` gradient-accumulation chunks whose
        losses use *global* normalisers (objective.py's docstring): token
        counts of the whole mini-batch, not a mean of micro-batch means.
        In bypass mode the correction runs inside the loss, per micro-batch
        (docs/math/correction.md §2), with unit normalisers and one division by
        the summed corrected count at the end.

Micro-batch i of a mini-batch holds its rows i, i + n, i + 2n, ... (strided):
a contiguous row block per device stays a contiguous block per device, so
splitting never moves data between devices.

Everything here is a pure function of arrays and the static `RunConfig`;
shapes are checked at trace time by the losses.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxcorr import sampling
from jaxcorr.losses import advantages as adv_lib
from jaxcorr.losses import correction as corr_lib
from jaxcorr.losses import masked, objective, rewards, value
from jaxcorr.model import token_logprobs
from jaxcorr.train.run_config import OptimConfig, RunConfig

# Metrics that are sums of globally normalised parts across micro-batches;
# every other micro-batch metric is averaged.
ADDITIVE = frozenset(
  {
    'actor/pg_loss',
    'actor/entropy',
    'actor/kl_loss',
    'actor/rollout_kl_loss',
    'actor/loss',
    'actor/loss_token_count',
    'actor/loss_seq_count',
    'critic/vf_loss',
  }
)


def combine_micro(key: str, values: jax.Array) -> jax.Array:
  """One mini-batch metric from its `[n_micro]` values: sums for the
  globally normalised terms, extremes for `*max`/`*min` statistics, means
  for the rest (per-call fractions and means, as in verl)."""
  if key in ADDITIVE:
    return jnp.sum(values)
  if key.endswith('max'):
    return jnp.max(values)
  if key.endswith('min'):
    return jnp.min(values)
  return jnp.mean(values)


@flax.struct.dataclass
class TrainState:
  """Everything the device side carries from step to step (checkpointed).

  `params` and `critic_params` are `nnx.State`s; `rng` is a raw uint32[2]
  key; `updates` counts optimizer updates (the schedule's clock).
  """

  params: Any
  opt_state: Any
  kl_ctrl: rewards.KLControllerState
  rng: jax.Array
  updates: jax.Array
  critic_params: Any = None
  critic_opt_state: Any = None


def make_optimizer(
  cfg: OptimConfig, peak_lr: float, total_updates: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """(AdamW with linear warmup then constant or cosine decay, after
  global-norm clipping; its learning-rate schedule)."""
  warmup = min(cfg.warmup_steps, max(total_updates - 1, 0))
  if cfg.schedule == 'cosine':
    schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0 if warmup else peak_lr,
      peak_value=peak_lr,
      warmup_steps=warmup,
      decay_steps=max(total_updates, warmup + 1),
      end_value=peak_lr * cfg.min_lr_ratio,
    )
  elif warmup:
    schedule = optax.join_schedules(
      [
        optax.linear_schedule(0.0, peak_lr, warmup),
        optax.constant_schedule(peak_lr),
      ],
      [warmup],
    )
  else:
    schedule = optax.constant_schedule(peak_lr)
  chain = []
  if cfg.max_grad_norm > 0:
    chain.append(optax.clip_by_global_norm(cfg.max_grad_norm))
  chain.append(
    optax.adamw(
      schedule,
      b1=cfg.b1,
      b2=cfg.b2,
      eps=cfg.eps,
      weight_decay=cfg.weight_decay,
    )
  )
  return optax.chain(*chain), schedule


# ----------------------------------------------------------- row layout


def split_micro(tree: Any, n: int) -> Any:
  """[B, ...] -> [n, B/n, ...], micro-batch i = rows i, i + n, ..."""

  def one(x):
    return x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)

  return jax.tree.map(one, tree)


def merge_micro(tree: Any) -> Any:
  """Inverse of `split_micro`."""

  def one(x):
    x = x.swapaxes(0, 1)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])

  return jax.tree.map(one, tree)


def at_response(x: jax.Array, batch: dict) -> jax.Array:
  """Per-position outputs `[B, P + T, ...]` of `concat(prompt, response)`
  -> those predicting response token t, read at position P + t − 1
  (docs/math/rollout_contract.md §5): `[B, T, ...]`."""
  t = batch['response_mask'].shape[1]
  p = batch['tokens'].shape[1] - t
  return x[:, p - 1 : p - 1 + t]


def apply_updates(
  tx: optax.GradientTransformation,
  grads: Any,
  opt_state: Any,
  params: Any,
  shardings: Any = None,
) -> tuple[Any, Any]:
  """One optimizer step; the new params keep `shardings` (when given), so
  the next call of the step compiles to the same executable."""
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  if shardings is not None:
    params = jax.lax.with_sharding_constraint(params, shardings)
  return params, opt_state


# ------------------------------------------------------------ the steps


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
  ):
    self.run = run
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
    self.prepare = jax.jit(
      self._prepare,
      out_shardings=None
      if state_shardings is None
      else (state_shardings.kl_ctrl, None, None),
    )
    # The updated state keeps the input's shardings, so the next step's
    # call hits the same compiled executable.
    out = None if state_shardings is None else (state_shardings, None)
    self.update = jax.jit(self._update, donate_argnums=(0,), out_shardings=out)

  # ------------------------------------------------------------ scoring

  def response_logp(
    self, params: Any, batch: dict, *, entropy: bool = False
  ) -> Any:
    """log π(response token t) `[B, T]` (and the entropy), read at position
    P + t − 1 of `concat(prompt, response)`
    (docs/math/rollout_contract.md §5)."""
    model = nnx.merge(self.graphdef, params)
    if self.run.rollout.logprob_mode == 'truncated':
      return self._truncated_logp(model, batch, entropy)
    out = token_logprobs(
      model,
      batch['tokens'],
      temperature=batch['temperature'],
      segment_ids=batch['segment_ids'],
      return_entropy=entropy,
      chunk_size=self.run.model.logprob_chunk,
    )
    if entropy:
      return at_response(out[0], batch), at_response(out[1], batch)
    return at_response(out, batch)

  def _truncated_logp(self, model, batch, entropy):
    """docs/math/rollout_contract.md §2 'truncated': the engine's rule on the
    trainer's logits, over K' = K_θ ∪ {y_t} (a constant set), with
    full-vocabulary logits."""
    logits = model(batch['tokens'], segment_ids=batch['segment_ids'])
    logits = at_response(logits, batch)
    p = batch['tokens'].shape[1] - batch['response_mask'].shape[1]
    y = batch['tokens'][:, p:]
    row = lambda x: x[:, None]  # noqa: E731  [B] -> [B, 1] per position
    keep = sampling.support(
      jax.lax.stop_gradient(logits),
      row(batch['temperature']),
      row(batch['top_k']),
      row(batch['top_p']),
      row(batch['min_p']),
    )
    keep = keep | jax.nn.one_hot(y, logits.shape[-1], dtype=bool)
    full, trunc = sampling.token_logprobs(
      logits, y, row(batch['temperature']), keep
    )
    del full
    if not entropy:
      return trunc
    z = sampling.scaled_logits(logits, row(batch['temperature']))
    logp_all = jax.nn.log_softmax(z, axis=-1)
    finite = jnp.isfinite(logp_all)
    ent = -jnp.sum(
      jnp.where(finite, jnp.exp(logp_all) * logp_all, 0.0), axis=-1
    )
    return trunc, ent

  def critic_values(self, critic_params: Any, batch: dict) -> jax.Array:
    """V(state before response token t), `[B, T]` float32."""
    critic = nnx.merge(self.critic_graphdef, critic_params)
    v = critic(batch['tokens'], segment_ids=batch['segment_ids'])
    return at_response(v, batch)

  def _chunks(self) -> int:
    t = self.run.train
    return t.mini_batches * t.micro_batches

  def _score(self, fn, params, batch) -> jax.Array:
    """`fn(params, rows)` over the batch in micro-batch-sized chunks (the
    memory the update needs, not the whole batch's)."""
    n = self._chunks()
    keys = ('tokens', 'segment_ids', 'response_mask', 'temperature')
    keys += ('top_k', 'top_p', 'min_p')
    rows = split_micro({k: batch[k] for k in keys}, n)
    out = jax.lax.map(lambda r: fn(params, r), rows)
    return merge_micro(out)

  # ------------------------------------------------------------ prepare

  def _prepare(
    self,
    params: Any,
    critic_params: Any,
    kl_ctrl: rewards.KLControllerState,
    ref_params: Any,
    batch: dict,
  ):
    self.traces['prepare'] += 1
    run = self.run
    corr = run.losses.correction
    alg = run.algorithm
    sg = jax.lax.stop_gradient
    mask = batch['response_mask']
    arrays = dict(batch)
    metrics: dict[str, jax.Array] = {}
    logp_fn = self.response_logp
    if run.decoupled:
      arrays['old_logp'] = sg(self._score(logp_fn, params, batch))
    if run.needs_ref:
      arrays['ref_logp'] = sg(self._score(logp_fn, ref_params, batch))
    if run.critic.enabled:
      arrays['values'] = sg(
        self._score(self.critic_values, critic_params, batch)
      )
    scores = rewards.place_at_last_token(batch['seq_reward'], mask)
    if alg.kl_in_reward is not None:
      behaviour = arrays['old_logp'] if run.decoupled else batch['rollout_logp']
      scores, _, kl_metrics = rewards.apply_kl_penalty(
        scores,
        behaviour,
        arrays['ref_logp'],
        mask,
        kl_ctrl.coef,
        estimator=alg.kl_penalty,
      )
      metrics.update(kl_metrics)
      kl_ctrl = rewards.update_kl_controller(
        kl_ctrl,
        kl_metrics[rewards.KL_METRIC],
        run.rollout.batch_size,
        alg.kl_in_reward,
      )
    adv, returns = adv_lib.advantages_from_config(
      alg.advantage,
      scores,
      mask,
      batch['group_ids'],
      values=arrays.get('values'),
    )
    arrays['advantages'] = adv
    arrays['returns'] = returns
    if run.decoupled and corr is not None:
      c = corr_lib.rollout_correction(
        arrays['old_logp'], batch['rollout_logp'], mask, corr
      )
      arrays['corr_weights'] = c.weights
      arrays['corr_mask'] = c.mask
      metrics.update(c.metrics)
    valid = jnp.any(mask, axis=-1)
    metrics['advantages/mean'] = masked.masked_mean(adv, mask)
    metrics['advantages/max'] = masked.masked_max(adv, mask)
    metrics['advantages/min'] = masked.masked_min(adv, mask)
    metrics['returns/mean'] = masked.masked_mean(returns, mask)
    metrics['batch/valid_rows'] = jnp.sum(valid, dtype=jnp.float32)
    metrics['batch/valid_tokens'] = jnp.sum(mask, dtype=jnp.float32)
    if 'values' in arrays:
      metrics['critic/values_mean'] = masked.masked_mean(arrays['values'], mask)
    return kl_ctrl, arrays, metrics

  # ------------------------------------------------------------- update

  def _actor_loss(self, params, mic, counts, key):
    run = self.run
    corr = run.losses.correction
    logp, ent = self.response_logp(params, mic, entropy=True)
    correction = None
    if run.decoupled and corr is not None:
      correction = corr_lib.Correction(
        mic['corr_weights'], mic['corr_mask'], {}
      )
    return objective.actor_objective(
      run.losses.actor,
      corr,
      logp=logp,
      advantages=mic['advantages'],
      mask=mic['response_mask'],
      old_logp=mic['old_logp'] if run.decoupled else None,
      rollout_logp=mic['rollout_logp'],
      ref_logp=mic.get('ref_logp'),
      entropy=ent,
      correction=correction,
      num_tokens=counts[0],
      num_seqs=counts[1],
      norm=run.rollout.max_new_tokens,
      key=key,
    )

  def _critic_loss(self, critic_params, mic, counts):
    v = self.critic_values(critic_params, mic)
    return value.value_loss(
      v,
      mic['values'],
      mic['returns'],
      mic['response_mask'],
      cliprange_value=self.run.critic.cliprange_value,
      agg=self.run.critic.agg,
      num_tokens=counts[0],
      num_seqs=counts[1],
      norm=self.run.rollout.max_new_tokens,
    )

  def _minibatch_grads(self, state: TrainState, mb: dict, key: jax.Array):
    """Summed micro-batch gradients with global normalisers."""
    run = self.run
    n = run.train.micro_batches
    unit = not run.decoupled  # bypass: the mask is known only per micro
    if unit:
      counts = (jnp.float32(1), jnp.float32(1))
    else:
      m = mb['response_mask']
      if 'corr_mask' in mb:
        m = m & mb['corr_mask']
      counts = objective.loss_normalizers(m)
    critic_counts = objective.loss_normalizers(mb['response_mask'])
    micro = split_micro(mb, n)
    zeros = lambda p: jax.tree.map(jnp.zeros_like, p)  # noqa: E731
    actor_grad = jax.value_and_grad(self._actor_loss, has_aux=True)
    critic_grad = jax.value_and_grad(self._critic_loss, has_aux=True)

    def body(carry, xs):
      g_acc, cg_acc = carry
      mic, i = xs
      (loss, met), g = actor_grad(
        state.params, mic, counts, jax.random.fold_in(key, i)
      )
      met = dict(met, **{'actor/loss': loss})
      g_acc = jax.tree.map(jnp.add, g_acc, g)
      if run.critic.enabled:
        (_, cmet), cg = critic_grad(state.critic_params, mic, critic_counts)
        cg_acc = jax.tree.map(jnp.add, cg_acc, cg)
        met.update(cmet)
      return (g_acc, cg_acc), met

    init = (
      zeros(state.params),
      zeros(state.critic_params) if run.critic.enabled else None,
    )
    (grads, cgrads), met = jax.lax.scan(body, init, (micro, jnp.arange(n)))
    metrics = {k: combine_micro(k, v) for k, v in met.items()}
    if unit:
      kind = objective.normalizer_kind(run.losses.actor)
      if kind != 'none':
        key_ = (
          'actor/loss_token_count'
          if kind == 'tokens'
          else ('actor/loss_seq_count')
        )
        denom = jnp.maximum(metrics[key_], 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        for k in ADDITIVE - {'actor/loss_token_count', 'actor/loss_seq_count'}:
          if k in metrics and not k.startswith('critic/'):
            metrics[k] = metrics[k] / denom
    return grads, cgrads, metrics

  def _update(self, state: TrainState, arrays: dict):
    self.traces['update'] += 1
    run = self.run
    t = run.train
    rows = arrays['response_mask'].shape[0]
    mb = rows // t.mini_batches
    rng, key = jax.random.split(state.rng)
    order = []
    for e in range(t.ppo_epochs):
      if t.shuffle_minibatches:
        perm = jax.random.permutation(jax.random.fold_in(key, e), rows)
      else:
        perm = jnp.arange(rows)
      order.append(perm.reshape(t.mini_batches, mb))
    order = jnp.concatenate(order, 0)
    shard = self.state_shardings

    def one_update(state, xs):
      idx, i = xs
      sub = jax.tree.map(lambda x: x[idx], arrays)
      grads, cgrads, metrics = self._minibatch_grads(
        state, sub, jax.random.fold_in(key, 1000 + i)
      )
      metrics['actor/grad_norm'] = optax.tree.norm(grads)
      metrics['actor/lr'] = self.schedule(state.updates)
      params, opt_state = apply_updates(
        self.tx,
        grads,
        state.opt_state,
        state.params,
        None if shard is None else shard.params,
      )
      state = state.replace(
        params=params, opt_state=opt_state, updates=state.updates + 1
      )
      if run.critic.enabled:
        metrics['critic/grad_norm'] = optax.tree.norm(cgrads)
        cparams, copt = apply_updates(
          self.critic_tx,
          cgrads,
          state.critic_opt_state,
          state.critic_params,
          None if shard is None else shard.critic_params,
        )
        state = state.replace(critic_params=cparams, critic_opt_state=copt)
      return state, metrics

    steps = jnp.arange(order.shape[0])
    state, metrics = jax.lax.scan(one_update, state, (order, steps))
    metrics = jax.tree.map(jnp.mean, metrics)
    metrics['actor/updates'] = jnp.asarray(order.shape[0], jnp.float32)
    return state.replace(rng=rng), metrics


# ------------------------------------------------------------------ SFT


class SFTStep:
  """Cross-entropy warm-up on prompt -> answer rows (`loss_mask` marks the
  predicted answer tokens, `[B, S - 1]`)."""

  def __init__(
    self,
    graphdef: Any,
    tx: optax.GradientTransformation,
    *,
    chunk: int = 128,
    param_shardings: Any = None,
  ):
    self.graphdef = graphdef
    self.tx = tx
    self.chunk = chunk
    self.param_shardings = param_shardings
    self.step = jax.jit(self._step, donate_argnums=(0, 1))

  def loss(self, params: Any, batch: dict) -> tuple[jax.Array, dict]:
    model = nnx.merge(self.graphdef, params)
    logp = token_logprobs(
      model,
      batch['tokens'],
      segment_ids=batch['segment_ids'],
      chunk_size=self.chunk,
    )
    m = batch['loss_mask']
    n = jnp.maximum(jnp.sum(m, dtype=jnp.float32), 1.0)
    nll = -jnp.sum(jnp.where(m, logp, 0.0)) / n
    # Sequence accuracy under teacher forcing: every answer token is the
    # argmax would need logits; the mean token probability is cheap.
    return nll, {
      'sft/loss': nll,
      'sft/token_prob': jnp.sum(jnp.where(m, jnp.exp(logp), 0.0)) / n,
    }

  def _step(self, params, opt_state, batch):
    (_, metrics), grads = jax.value_and_grad(self.loss, has_aux=True)(
      params, batch
    )
    metrics['sft/grad_norm'] = optax.tree.norm(grads)
    params, opt_state = apply_updates(
      self.tx, grads, opt_state, params, self.param_shardings
    )
    return params, opt_state, metrics
