"""`train.trace_every`: per-token traces of a few rows of an RL step.

Every `train.trace_every`-th RL step the trainer keeps `train.trace_rows`
rows of its batch, token by token, in `<workdir>/traces/step_<N>.jsonl`
(N: the step of metrics.jsonl), one JSON object per row:

    step, trainer_version, row, group, sample, finish   where it came from
    prompt                 the prompt's text
    reward, seq_reward     the scorer's reward; after the overlong shaping
    rewards                {reward function: its unweighted value}
    ids, pieces            each response-side token and its text piece
    agent                  1: the policy's token, 0: the environment's
    mu, pi_old, pi_theta   log μ (the engine's), log π_old (the trainer's
                           before the update; μ in bypass mode), log π_θ
                           (the policy after the update)
    weight                 the correction's weight (decoupled mode with a
                           correction; null otherwise and off the mask)
    reason                 '' (trains) or why the token does not: 'env',
                           'row_dropped' (ERROR / ABORT / a row staler than
                           rollout.max_staleness), 'stale' (masked by
                           staleness_policy='mask'), 'seq_rejected' or
                           'token_rejected' (the correction's mask)
    version, staleness     the policy version that sampled it; the trainer
                           version minus that (null on environment tokens)
    advantage              the token's advantage

Per-token lists are columns of the row (`ids[t]`, `mu[t]`, ...), cut at
the last response-side token; a non-finite number is `null`.

Why JSONL, one file per trace step: a dashboard or `jq` reads one step
without touching the others, a file is written whole (a temporary file,
then a rename: a reader never sees half a row), resume deletes whole files,
and the rows are small (a few thousand numbers): Parquet's column store
buys nothing at that size and needs a reader to look at.

Cost: nothing on the other steps. On a trace step, after the update's
metrics are on the host anyway, one gather of the sampled rows' arrays
(`TrainBatch` fields the device already holds) and one forward pass of
those rows with the updated policy (π_θ; compiled once, on the first trace
step) are fetched in one `jax.device_get`; logged as `time/trace`.

Size cap: `train.trace_max_mb` over the whole folder; past it the oldest
files are deleted (the newest steps are the ones a collapse is read from).
Resume (`resume(step)`) deletes the files of steps after the checkpoint,
as metrics.jsonl drops its lines.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from etils import epath

from jaxcorr.rollout import FinishReason

DIRNAME = 'traces'
_FILE = re.compile(r'step_(\d+)\.jsonl$')
# Reasons a response-side token does not train (module doc).
REASONS = ('', 'env', 'row_dropped', 'stale', 'seq_rejected', 'token_rejected')


def trace_path(workdir: str, step: int) -> epath.Path:
  return epath.Path(workdir) / DIRNAME / f'step_{step}.jsonl'


def trace_steps(workdir: str) -> list[int]:
  """The steps that have a trace file, ascending (none: [])."""
  folder = epath.Path(workdir) / DIRNAME
  if not folder.exists():
    return []
  steps = [_FILE.match(p.name) for p in folder.iterdir()]
  return sorted(int(m.group(1)) for m in steps if m)


def read_trace(workdir: str, step: int) -> list[dict[str, Any]]:
  """The rows of trace step `step`; `null` numbers read as None."""
  text = trace_path(workdir, step).read_text(encoding='utf-8')
  return [json.loads(line) for line in text.split('\n') if line.strip()]


def select_rows(live: np.ndarray, n: int, seed: int, step: int) -> np.ndarray:
  """Up to `n` row indices, ascending, drawn without replacement from the
  rows where `live` holds, reproducibly from (seed, step)."""
  rows = np.flatnonzero(live)
  if rows.size <= n:
    return rows
  rng = np.random.default_rng((seed, step, 0x7ACE))
  return np.sort(rng.choice(rows, size=n, replace=False))


def _floats(x: np.ndarray, keep: np.ndarray | None = None) -> list:
  """JSON numbers of `x`, None where not finite or (with `keep`) off it."""
  # float32 values: 7 significant digits hold them exactly enough.
  out = [
    float(f'{v:.7g}') if math.isfinite(v) else None
    for v in np.asarray(x, float)
  ]
  if keep is not None:
    out = [v if k else None for v, k in zip(out, keep)]
  return out


def token_reasons(
  context: np.ndarray,
  agent: np.ndarray,
  trains: np.ndarray,
  row_kept: bool,
  corr_mask: np.ndarray | None,
) -> list[str]:
  """Each response-side token's reason of `REASONS` (one row: `[T]` bools;
  `trains`: the batch's response mask, before the correction)."""
  seq_rejected = corr_mask is not None and not (corr_mask & trains).any()
  out = []
  for t in range(context.shape[0]):
    if not context[t] or not agent[t]:
      out.append('env' if context[t] else '')
    elif not row_kept:
      out.append('row_dropped')
    elif not trains[t]:
      out.append('stale')
    elif corr_mask is not None and not corr_mask[t]:
      out.append('seq_rejected' if seq_rejected else 'token_rejected')
    else:
      out.append('')
  return out


class TraceWriter:
  """The trace files of a workdir (module doc); `enabled=False` (every
  process but the first) writes nothing."""

  def __init__(self, workdir: str, *, max_mb: float, enabled: bool = True):
    self.folder = epath.Path(workdir) / DIRNAME
    self.workdir = workdir
    self.max_bytes = int(max_mb * 2**20)
    self.enabled = enabled
    self._sizes: dict[int, int] | None = None  # listed on first use

  def sizes(self) -> dict[int, int]:
    if self._sizes is None:
      self._sizes = {
        s: trace_path(self.workdir, s).stat().length
        for s in trace_steps(self.workdir)
      }
    return self._sizes

  def write(self, step: int, rows: Sequence[dict[str, Any]]) -> None:
    """Write trace step `step` whole, then trim the folder to the cap."""
    if not self.enabled:
      return
    self.folder.mkdir(parents=True, exist_ok=True)
    out = trace_path(self.workdir, step)
    tmp = out.parent / f'.{out.name}.tmp'
    text = ''.join(json.dumps(r, allow_nan=False) + '\n' for r in rows)
    tmp.write_text(text, encoding='utf-8')
    tmp.replace(out)
    sizes = self.sizes()
    sizes[step] = len(text.encode('utf-8'))
    while len(sizes) > 1 and sum(sizes.values()) > self.max_bytes:
      oldest = min(sizes)
      trace_path(self.workdir, oldest).unlink(missing_ok=True)
      del sizes[oldest]
      logging.log_first_n(
        logging.WARNING,
        'traces over train.trace_max_mb: deleting the oldest (step %d)',
        1,
        oldest,
      )

  def resume(self, step: int) -> None:
    """A run resumed from checkpoint `step` writes the later steps again:
    their files go (all of them at step 0)."""
    if not self.enabled:
      return
    for s in list(self.sizes()):
      if s > step or step == 0:
        trace_path(self.workdir, s).unlink(missing_ok=True)
        del self.sizes()[s]


class Tracer:
  """Collects the trace rows of a step and hands them to its writer.

  Args:
    every: `train.trace_every` (0: never); rows: `train.trace_rows`.
    seed: `train.seed` (which rows are drawn).
    writer: where the rows go.
    policy_logp: jitted `(params, TrainBatch) -> [B, T]` log-probs (π_θ).
    decode: token ids -> text (the run's tokenizer).
    reward_names: the reward functions, in `Scored.scores` order.
  """

  def __init__(
    self,
    *,
    every: int,
    rows: int,
    seed: int,
    writer: TraceWriter,
    policy_logp: Callable[[Any, Any], Any],
    decode: Callable[[Sequence[int]], str],
    reward_names: Sequence[str] = (),
  ):
    self.every, self.rows, self.seed = every, rows, seed
    self.writer = writer
    self.policy_logp = policy_logp
    self.decode = decode
    self.reward_names = tuple(reward_names)

  def due(self, step: int) -> bool:
    return self.every > 0 and step % self.every == 0

  def record(
    self, step: int, scored: Any, host_batch: Any, device_batch: Any, params
  ) -> list[dict[str, Any]]:
    """The trace rows of metrics step `step` (trainer version step − 1):
    `scored` (`Scored`), the host `TrainBatch` and its prepared device
    copy, the updated policy's params; written, and returned."""
    rb = scored.batch
    finish = np.asarray(rb.finish_reason)
    # Rows of this process (the first rows of the global batch on process
    # 0, the one that writes), not padding. The gather below is one
    # program on every process: with several, the rows are drawn from
    # (seed, step) alone, the same everywhere, padding or not.
    live = (finish != FinishReason.PAD) & np.asarray(rb.context_mask).any(1)
    if jax.process_count() > 1:
      live = np.ones_like(live)
    idx = select_rows(live, self.rows, self.seed, step)
    if idx.size == 0:
      return []
    sub = jax.tree.map(lambda x: x[idx], device_batch)
    fetched = jax.device_get(
      {
        'pi_theta': self.policy_logp(params, sub),
        'pi_old': sub.old_logp,
        'weight': sub.corr_weights,
        'corr_mask': sub.corr_mask,
        'advantage': sub.advantages,
      }
    )
    rows = [
      self._row(step, scored, host_batch, fetched, j, int(i))
      for j, i in enumerate(idx)
    ]
    self.writer.write(step, rows)
    return rows

  def _row(self, step, scored, hb, fetched, j: int, i: int) -> dict:
    rb = scored.batch
    context = np.asarray(rb.context_mask[i], bool)
    n = int(np.flatnonzero(context).max()) + 1 if context.any() else 0
    context = context[:n]
    agent = np.asarray(rb.response_mask[i, :n], bool)
    trains = np.asarray(hb.response_mask[i, :n], bool)
    ids = [int(t) for t in np.asarray(rb.response_tokens[i, :n])]
    version = np.asarray(rb.policy_version[i, :n])
    on_policy = agent & (version >= 0)
    mu = np.asarray(rb.rollout_logp[i, :n])
    get = lambda k: None if fetched[k] is None else fetched[k][j, :n]  # noqa: E731
    pi_old = get('pi_old')
    weight, corr = get('weight'), get('corr_mask')
    prompt = np.asarray(rb.prompt_tokens[i])[np.asarray(rb.prompt_mask[i])]
    scores = scored.scores
    return {
      'step': step,
      'trainer_version': step - 1,
      'row': i,
      'group': int(rb.group_id[i]),
      'sample': int(rb.sample_id[i]),
      'finish': FinishReason(int(rb.finish_reason[i])).name,
      'prompt': self.decode([int(t) for t in prompt]),
      'reward': float(scored.rewards[i]),
      'seq_reward': float(hb.seq_reward[i]),
      'rewards': {}
      if scores is None
      else {k: float(scores[f, i]) for f, k in enumerate(self.reward_names)},
      'ids': ids,
      'pieces': [self.decode([t]) for t in ids],
      'agent': [int(a) for a in agent],
      'mu': _floats(mu, agent),
      'pi_old': _floats(mu if pi_old is None else pi_old, agent),
      'pi_theta': _floats(get('pi_theta'), agent),
      'weight': None if weight is None else _floats(weight, trains),
      'reason': token_reasons(context, agent, trains, bool(trains.any()), corr),
      'version': [int(v) if ok else None for v, ok in zip(version, on_policy)],
      'staleness': [
        step - 1 - int(v) if ok else None for v, ok in zip(version, on_policy)
      ],
      'advantage': _floats(get('advantage'), agent),
    }
