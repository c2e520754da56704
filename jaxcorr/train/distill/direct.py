"""The direct distillation losses in the update (`distill.loss` 'reverse_kl',
'topk_kl', 'gjsd'; docs/distillation.md, "Direct losses").

    prepare   the teacher's `[B, T]` log-probs of the sampled tokens
              (`score.teacher_scores`), or for the top-k losses its top-k
              ids and log-probs `[B, T, K]` at the row's temperature, into
              the `TrainBatch`; without `distill.task_reward` the
              advantages are zeroed, so the policy loss adds nothing but
              `config.actor`'s own regularisers
    update    per micro-batch, the library loss on the *current* student's
              log-probs (the forward whose gradient the step takes):

        L = actor objective + coef · share · D,    share = n_micro / N

              D is `losses.distill.reverse_kl_loss` (k1/k3),
              `topk_kl` (the student's full-softmax log-probs at the
              teacher's ids) or `generalized_jsd` on the teacher's top-k
              plus the rest of the mass (`with_rest`); n_micro the
              micro-batch's loss tokens and N the mini-batch's
              (`counts[0]`), so the micro-batches sum to D's token mean over
              the mini-batch, like the MoE balance terms. The teacher's
              arrays are constants: no gradient reaches the teacher.

Top-k memory: the teacher's full distribution is `[B, T, V]` (V ~ 50-150k),
too large to carry; the K ids and log-probs are `[B, T, K]`. The student's
side needs its full-vocabulary log-softmax at the response positions, one
micro-batch's `[rows, T, V]` float32 logits (as `rollout.logprob_mode=
'truncated'` does), from the same forward as the policy loss's log-probs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcorr import sampling
from jaxcorr.losses import distill as distill_loss
from jaxcorr.losses import masked
from jaxcorr.model.lora import enable_dropout
from jaxcorr.model.transformer import entropy_terms
from jaxcorr.train import scoring
from jaxcorr.train.batch import TrainBatch
from jaxcorr.train.distill import score
from jaxcorr.train.distill.rules import needs_topk

LOSS_METRIC = 'distill/loss'
"""The direct term's value (before `coef`), summed over micro-batches."""


def _vocab(model: Any) -> int:
  cfg = model.config
  return cfg.real_vocab_size or cfg.vocab_size


def response_log_softmax(model: Any, batch: TrainBatch) -> jax.Array:
  """`[rows, T, V]` float32 log softmax(z / τ_row) at the positions that
  predict the response tokens (padded vocabulary columns −inf)."""
  hidden, _ = model.hidden_states(batch.tokens, segment_ids=batch.segment_ids)
  logits = model.logits(scoring.at_response(hidden, batch))
  z = sampling.scaled_logits(logits, batch.temperature[:, None])
  return jax.nn.log_softmax(z, axis=-1)


def teacher_topk(run: Any, teacher: Any, batch: TrainBatch):
  """(ids int32, log-probs float32), both `[B, T, K]`: the teacher's K =
  min(distill.topk, vocabulary) most likely tokens at every response
  position, in micro-batch-sized chunks, under `stop_gradient`."""

  def one(params, rows):
    model = nnx.merge(teacher.graphdef, params)
    k = min(run.distill.topk, _vocab(model))
    vals, ids = jax.lax.top_k(response_log_softmax(model, rows), k)
    return ids.astype(jnp.int32), vals

  chunks = run.train.mini_batches * run.train.micro_batches
  out = scoring.in_chunks(one, teacher.params, batch, chunks)
  return jax.lax.stop_gradient(out)


def prepare_fields(
  run: Any, teacher: Any, batch: TrainBatch
) -> tuple[TrainBatch, dict[str, jax.Array]]:
  """`batch` with the teacher's fields the update's term reads (module
  docstring), and the `teacher_corr/` metrics of an engine-served
  teacher."""
  fields: dict[str, Any] = {}
  metrics: dict[str, jax.Array] = {}
  if needs_topk(run):
    ids, vals = teacher_topk(run, teacher, batch)
    fields.update(teacher_topk_ids=ids, teacher_topk_logp=vals)
    if run.distill.logp_source == 'engine':  # the gap, reported only
      _, metrics = score.teacher_scores(run, teacher, batch)
  else:
    fields['teacher_logp'], metrics = score.teacher_scores(run, teacher, batch)
  if not run.distill.task_reward:
    fields['advantages'] = jnp.zeros_like(batch.advantages)
  return batch.replace(**fields), metrics


def student_forward(
  run: Any,
  graphdef: Any,
  params: Any,
  mic: TrainBatch,
  *,
  entropy: bool,
  dropout_key: jax.Array | None = None,
):
  """((log π_θ of the sampled tokens, entropy or None) `[rows, T]`, log π_θ
  at the teacher's top-k ids `[rows, T, K]`, for 'gjsd' with K < V the
  mass off them as entry K + 1, exactly: the logsumexp off the support):
  one forward, the full softmax at the row's temperature."""
  rest = run.distill.loss == 'gjsd'
  model = nnx.merge(graphdef, params)
  if dropout_key is not None:
    enable_dropout(model, dropout_key)
  logp_all = response_log_softmax(model, mic)
  t = mic.response_mask.shape[1]
  y = mic.tokens[:, -t:, None]
  logp = sampling.nonpositive(jnp.take_along_axis(logp_all, y, -1)[..., 0])
  ent = None
  if entropy:
    finite = jnp.isfinite(logp_all)
    terms = entropy_terms(jnp.exp(logp_all), jnp.where(finite, logp_all, 0))
    ent = -jnp.sum(terms, axis=-1)
  ids = mic.teacher_topk_ids
  topk = jnp.take_along_axis(logp_all, ids, -1)
  if rest and ids.shape[-1] < _vocab(model):  # gjsd: + the rest's mass
    rows, pos = jnp.indices(ids.shape[:2])
    on = jnp.zeros(logp_all.shape, bool)
    on = on.at[rows[..., None], pos[..., None], ids].set(True)
    off = jax.nn.logsumexp(jnp.where(on, -jnp.inf, logp_all), axis=-1)
    topk = distill_loss.with_rest(topk, off)
  return (logp, ent), topk


def loss_value(
  run: Any, mask: jax.Array, logp: jax.Array, topk: Any, mic: TrainBatch
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The library loss of `distill.loss` on one micro-batch (a token mean
  over `mask`) and its `distill/` metrics."""
  cfg = run.distill
  if cfg.loss == 'reverse_kl':
    return distill_loss.reverse_kl_loss(
      logp, mic.teacher_logp, mask, cfg.loss_clamp, estimator=cfg.estimator
    )
  t = mic.teacher_topk_logp
  if cfg.loss == 'topk_kl':
    return distill_loss.topk_kl(
      topk, t, mask, cfg.loss_clamp, direction=cfg.topk_direction
    )
  if topk.shape[-1] == t.shape[-1] + 1:  # K < V: the rest of the mass
    t = distill_loss.with_rest(t)
  return distill_loss.generalized_jsd(topk, t, mask, beta=cfg.beta)


def update_term(
  run: Any, mic: TrainBatch, logp: jax.Array, topk: Any, counts: Any
) -> tuple[jax.Array, dict[str, jax.Array], dict[str, jax.Array]]:
  """(coef · share · D, metrics, the weights that average the mean-type
  metrics over micro-batches) of one update micro-batch (module
  docstring)."""
  mask = mic.response_mask
  if mic.corr_mask is not None:
    mask = mask & mic.corr_mask
  value, metrics = loss_value(run, mask, logp, topk, mic)
  n = masked.count(mask, jnp.float32)
  term = value * n / jnp.maximum(counts[0], 1.0)
  weights = {k: n for k in metrics if not k.endswith('max')}
  metrics = dict(metrics, **{LOSS_METRIC: jax.lax.stop_gradient(term)})
  return run.distill.coef * term, metrics, weights
