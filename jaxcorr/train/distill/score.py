"""The teacher's log-probs of the student's sampled tokens, and the
distillation advantage `prepare` trains on.

    trainer-side   `scoring.response_logp` with the teacher's graph and
                   params ('full' log-probs whatever rollout.logprob_mode),
                   no gradient, in distill.teacher_dtype
    engine         `scoring.exact_logp`: the teacher as the engine holds it
                   (rollout.engine_dtype) scoring the sampled ids, prefill
                   only; the trainer-side pass runs too and `teacher_corr/`
                   reports the gap (`losses.distill.teacher_gap_metrics`)

Correction of the teacher's own gap: with both passes the trainer-side
log-probs are the teacher's distribution, so `correct_teacher=True` trains
on them (the gap is measured, then removed). A TIS-style truncation of
exp(t_trainer − t_engine) was considered and not taken: it would need the
trainer-side pass anyway, and with it in hand there is nothing left to
estimate.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from jaxcorr.losses import distill as distill_loss
from jaxcorr.model.lora import LoraConfig
from jaxcorr.train import scoring
from jaxcorr.train.batch import TrainBatch
from jaxcorr.train.distill import mopd
from jaxcorr.train.distill.teacher import Teachers


def _teacher_run(run: Any) -> Any:
  """`run` as the teacher reads it: every token's full log-prob (no kept
  sets: those are the student's sampling support), no LoRA, and an MoE
  teacher routing by itself (the batch's recorded routing is the
  student's)."""
  rollout = dataclasses.replace(run.rollout, logprob_mode='full')
  moe = dataclasses.replace(run.moe, router_replay='none')
  return dataclasses.replace(run, rollout=rollout, lora=LoraConfig(), moe=moe)


def teacher_forward(run: Any, graphdef: Any, *, engine: bool) -> Any:
  """`fn(params, rows) -> [b, T]`: one teacher's trainer-side forward
  (`scoring.response_logp`) or the engine's (`scoring.exact_logp`)."""
  score = scoring.exact_logp if engine else scoring.response_logp
  return functools.partial(score, _teacher_run(run), graphdef)


def teacher_logp(
  run: Any, graphdef: Any, params: Any, batch: TrainBatch, *, engine: bool
) -> jax.Array:
  """`[B, T]` teacher log-probs of the batch's response tokens (0 off the
  response), in micro-batch-sized chunks, under `stop_gradient`."""
  fn = teacher_forward(run, graphdef, engine=engine)
  chunks = run.train.mini_batches * run.train.micro_batches
  return jax.lax.stop_gradient(scoring.in_chunks(fn, params, batch, chunks))


def teacher_scores(
  run: Any, teacher: Any, batch: TrainBatch
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(the `[B, T]` teacher log-probs the run trains on, the
  `teacher_corr/` metrics when the engine pass runs too); with several
  teachers (`Teachers`) each row's own teacher's (jaxcorr/train/distill/
  mopd.py) and the `distill/<name>/` metrics."""
  if isinstance(teacher, Teachers):
    forward = functools.partial(teacher_forward, run)
    return mopd.routed_scores(run, teacher, batch, forward)
  cfg = run.distill
  graphdef, params = teacher.graphdef, teacher.params
  trainer = teacher_logp(run, graphdef, params, batch, engine=False)
  if cfg.logp_source != 'engine':
    return trainer, {}
  engine = teacher_logp(run, graphdef, params, batch, engine=True)
  mask = batch.response_mask
  metrics = distill_loss.teacher_gap_metrics(trainer, engine, mask)
  return (trainer if cfg.correct_teacher else engine), metrics


def distill_advantages(
  run: Any, teacher: Any, batch: TrainBatch
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The advantages `prepare` hands the update, and the `distill/` (and
  `teacher_corr/`) metrics. The student side is the behaviour policy
  (π_old in decoupled mode, μ in bypass), so the reward is fixed before
  the update and the policy loss's correction applies unchanged."""
  cfg = run.distill
  mask = batch.response_mask
  teacher, metrics = teacher_scores(run, teacher, batch)
  student = batch.old_logp if run.decoupled else batch.rollout_logp
  adv, kl_metrics = distill_loss.reverse_kl_advantage(
    student,
    teacher,
    mask,
    batch.advantages if cfg.task_reward else None,
    cfg.coef,
    estimator=cfg.estimator,
  )
  return adv, {**metrics, **kl_metrics}
