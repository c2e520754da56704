"""Multi-teacher distillation (MOPD): each row scored by its own teacher.

Row b's teacher is `route[task_id[b]]` (`teacher.Teachers`, the table
`routes.route_table` fixed at start-up); a row without response tokens
(padding, a dropped row) or of a task outside the table has none (-1).

Cost: each teacher runs on its own rows only, not on every row with a
selection after. Under jit the shapes are static, so the rows are sorted
by teacher (rows without one first) and cut into the update's
micro-batch-sized chunks; in each chunk teacher k's forward runs under a
`lax.cond` on "the chunk holds a row of k", so a chunk pays for the
teachers it holds: with K teachers and n chunks, n + K − 1 chunk forwards
at most instead of K·n (all rows then select), and nothing for the
padding. The sort and its inverse are a gather and a scatter of the
batch's token rows, cheap next to a forward; the chunks keep the batch's
row sharding (`sharding.constrain`), so each forward stays data-parallel.

A row with no teacher is given the behaviour student's log-probs as its
teacher's: its reverse KL is exactly 0, so it carries no distillation
signal (its advantage is the task's with `distill.task_reward`, else 0),
and `distill/untaught_rows` counts it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxcorr import sharding
from jaxcorr.losses import distill as distill_loss
from jaxcorr.losses import masked
from jaxcorr.train.batch import TrainBatch

NO_TEACHER = -1


def row_teachers(route: tuple[int, ...], batch: TrainBatch) -> jax.Array:
  """`[B]` int32: each row's teacher index, -1 where it has none."""
  table = jnp.asarray((*route, NO_TEACHER), jnp.int32)
  if batch.task_id is None:
    raise ValueError(
      'TrainBatch.task_id is None with config.distill.teachers: the '
      "rollouts' scoring (RolloutStage.score) sets it"
    )
  task = batch.task_id.astype(jnp.int32)
  known = (task >= 0) & (task < len(route))
  ids = table[jnp.where(known, task, len(route))]
  return jnp.where(jnp.any(batch.response_mask, -1), ids, NO_TEACHER)


def _chunk_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
  """Rows `idx` ([n, m]) of `x`, sharded over m like the batch's rows."""
  out = x[idx]
  return sharding.constrain(out, (None, 'batch') + (None,) * (x.ndim - 1))


def routed_logp(
  run: Any, teachers: Any, batch: TrainBatch, ids: jax.Array, fns: list
) -> jax.Array:
  """`[B, T]` log-probs of each row under its teacher (0 for rows with
  none): `fns[k](params, rows)` is teacher k's forward (module doc)."""
  n = run.train.mini_batches * run.train.micro_batches
  b = batch.rows
  order = jnp.argsort(ids, stable=True)
  idx = order.reshape(n, b // n)
  rows = jax.tree.map(
    functools.partial(_chunk_rows, idx=idx), batch.for_scoring()
  )
  chunk_ids = ids[idx]

  def chunk(xs):
    r, cid = xs
    out = jnp.zeros(r.response_mask.shape, jnp.float32)
    for k, (fn, t) in enumerate(zip(fns, teachers.members)):

      def run_k(r, fn=fn, t=t):
        return fn(t.params, r).astype(jnp.float32)

      def skip(r):
        return jnp.zeros(r.response_mask.shape, jnp.float32)

      mine = cid == k
      logp = jax.lax.cond(jnp.any(mine), run_k, skip, r)
      out = jnp.where(mine[:, None], logp, out)
    return out

  out = jax.lax.map(chunk, (rows, chunk_ids)).reshape(b, -1)
  out = jnp.zeros_like(out).at[order].set(out)
  return jax.lax.stop_gradient(sharding.constrain(out, ('batch', None)))


def routed_scores(
  run: Any, teachers: Any, batch: TrainBatch, teacher_fn: Any
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(`[B, T]` teacher log-probs, each row's own teacher's, the metrics:
  `teacher_corr/` with the engine pass, `distill/<name>/` per teacher).
  `teacher_fn(graphdef, engine=)` is one teacher's forward."""
  cfg = run.distill
  mask = batch.response_mask
  ids = row_teachers(teachers.route, batch)

  def scores(engine: bool) -> jax.Array:
    fns = [teacher_fn(t.graphdef, engine=engine) for t in teachers.members]
    return routed_logp(run, teachers, batch, ids, fns)

  trainer, metrics = scores(False), {}
  used = trainer
  taught = (ids >= 0)[:, None]
  if cfg.logp_source == 'engine':
    engine = scores(True)
    m = mask & taught
    metrics.update(distill_loss.teacher_gap_metrics(trainer, engine, m))
    used = trainer if cfg.correct_teacher else engine
  student = batch.old_logp if run.decoupled else batch.rollout_logp
  used = jnp.where(taught, used, student)
  metrics.update(
    teacher_metrics(teachers.names, ids, student, used, batch, cfg.estimator)
  )
  return used, metrics


def teacher_metrics(
  names: tuple[str, ...],
  ids: jax.Array,
  student: jax.Array,
  teacher: jax.Array,
  batch: TrainBatch,
  estimator: str,
) -> dict[str, jax.Array]:
  """`distill/<name>/reverse_kl` (the behaviour student's, as
  `distill/reverse_kl`), `.../teacher_logp` and `.../rows` per teacher,
  and `distill/untaught_rows`."""
  mask = batch.response_mask
  dtype = masked.float_dtype(student, teacher)
  s = masked.sanitize(student, mask, dtype)
  t = masked.sanitize(teacher, mask, dtype)
  kl = distill_loss.per_token_reverse_kl(s, t, mask, estimator)
  live = jnp.any(mask, -1)
  out = {'distill/untaught_rows': jnp.sum(live & (ids < 0), dtype=jnp.float32)}
  for k, name in enumerate(names):
    m = mask & (ids == k)[:, None]
    out[f'distill/{name}/reverse_kl'] = masked.masked_mean(kl, m)
    out[f'distill/{name}/teacher_logp'] = masked.masked_mean(t, m)
    out[f'distill/{name}/rows'] = jnp.sum(ids == k, dtype=jnp.float32)
  return out
