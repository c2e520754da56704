"""Host side of a step: `RolloutBatch` + rewards -> the trainer's arrays.

`assemble` runs in numpy after validation and before the one transfer to the
devices. It

* drops rows the contract says to drop (docs/math/rollout_contract.md §6): ABORT
  and ERROR rows become empty rows (every mask False), and so do rows staler
  than `rollout.max_staleness`, or with `rollout.staleness_policy='mask'` only
  their stale tokens leave the mask (jaxcorr/train/rollouts/staleness.py);
* picks μ by `rollout.logprob_mode` (`rollout_logp` or its truncated value;
  'replay' also carries the engine's kept sets, rollout/kept_set.py); a
  missing μ is an error, never zeros;
* records each token's version gap (trainer version − its policy version)
  for the correction's per-gap metrics;
* lays prompt and response out as one `[B, P + T]` token row with segment
  ids (1 on real tokens) so positions count from the first real prompt token
  in the trainer exactly as in the engine (docs/math/rollout_contract.md §3);
* pads the batch with complete PAD rows up to a multiple of `row_multiple`
  (mini-batches x micro-batches x the mesh's batch shards). A padding row
  carries every per-token field, `rollout_logp` included, as zeros with the
  mask off (docs/math/rollout_contract.md §5; SkyRL once dropped `rollout_logp`
  from padding micro-batches). Losses and metrics are identical with and without
  them.

With the overlong shaping of the `reward` section (jaxcorr/losses/
overlong.py) `assemble` also adds DAPO's soft overlong penalty to the
sequence reward (`overlong_penalty_at='reward'`) or stores it per row for the
update (`'loss'`), and marks the truncated rows (finish LENGTH) whose loss
`mask_truncated_completions` removes after the advantages.

`rollout_metrics` computes the `rollout/` (and, off sync mode, `staleness/`)
metrics of docs/math/rollout_contract.md §6 on the host, where the versions
and finish reasons already are; `to_device` is the one transfer of a host
batch to the trainer's mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import flax.struct
import jax
import numpy as np

from jaxcorr import sharding
from jaxcorr.losses import overlong as overlong_lib
from jaxcorr.rollout import FinishReason, RolloutBatch
from jaxcorr.train.rollouts import staleness as staleness_lib
from jaxcorr.train.tracker.reduction import Metric, Metrics

Array = Any  # np.ndarray on the host, jax.Array on the devices


@flax.struct.dataclass
class TrainBatch:
  """The rows of one RL step, from `assemble` (host, numpy) to the loss.

  B rows (padded to a multiple of `row_multiple`), P prompt and T response
  positions. `prepare` (jaxcorr/train/prepare.py) fills the fields after
  `seq_reward`; a field a run does not need stays None.
  """

  tokens: Array  # [B, P + T] int32: prompt then response, 0 off segment
  segment_ids: Array  # [B, P + T] int32: 1 on real tokens
  response_mask: Array  # [B, T] bool: the response tokens that train
  rollout_logp: Array  # [B, T] float32: μ, 0 off the mask
  temperature: Array  # [B] float32: the row's sampling parameters
  top_k: Array  # [B] int32
  top_p: Array  # [B] float32
  min_p: Array  # [B] float32
  group_ids: Array  # [B] int32: rows of one prompt share an id
  seq_reward: Array  # [B] float32: 0 for dropped rows
  old_logp: Array | None = None  # [B, T] float32: π_old (decoupled mode)
  ref_logp: Array | None = None  # [B, T] float32: π_ref (reference KL)
  values: Array | None = None  # [B, T] float32: the critic's V
  advantages: Array | None = None  # [B, T] float32
  returns: Array | None = None  # [B, T] float32
  corr_weights: Array | None = None  # [B, T] float32: decoupled correction
  corr_mask: Array | None = None  # [B, T] bool: rows/tokens it keeps
  # logprob_mode='replay': the engine's kept sets (count 0 off the mask).
  kept_ids: Array | None = None  # [B, T, C] int32, -1 past kept_count
  kept_count: Array | None = None  # [B, T] int32
  # Trainer version − the token's policy version, 0 off the mask.
  version_gap: Array | None = None  # [B, T] int32
  # MoE routing replay (docs/moe.md), -1 (model.moe.NO_EXPERT) where none: the
  # engine's (R3) and the trainer's π_old pass's (R2, filled by prepare).
  routed_experts: Array | None = None  # [B, P + T, L_moe, k] int32
  old_experts: Array | None = None  # [B, P + T, L_moe, k] int32
  # Overlong shaping (losses/overlong.py), None when off: rows whose loss
  # mask_truncated_completions removes, the 'loss'-placed penalty.
  truncated: Array | None = None  # [B] bool
  overlong_penalty: Array | None = None  # [B] float32
  # The prompt's task (jaxcorr/data/task_ids.py), -1 on padding rows: what
  # multi-teacher distillation routes by (jaxcorr/train/distill/routes.py).
  task_id: Array | None = None  # [B] int32
  # A direct distillation loss (config.distill.loss, train/distill/direct.py),
  # filled by prepare: the teacher's log-probs of the sampled tokens and,
  # for 'topk_kl' / 'gjsd', its top-k ids and log-probs per position.
  teacher_logp: Array | None = None  # [B, T] float32
  teacher_topk_ids: Array | None = None  # [B, T, K] int32
  teacher_topk_logp: Array | None = None  # [B, T, K] float32

  @property
  def rows(self) -> int:
    return self.response_mask.shape[0]

  def for_scoring(self) -> TrainBatch:
    """Only what a forward pass reads (tokens, segments, the response
    length and sampling parameters): what `scoring.in_chunks` carries."""
    none = dict.fromkeys(_TRAINING_FIELDS)
    return self.replace(
      rollout_logp=None,
      group_ids=None,
      seq_reward=None,
      version_gap=None,
      truncated=None,
      overlong_penalty=None,
      task_id=None,
      **none,
    )


_TRAINING_FIELDS = (
  'old_logp',
  'ref_logp',
  'values',
  'advantages',
  'returns',
  'corr_weights',
  'corr_mask',
  'old_experts',
  'teacher_logp',
  'teacher_topk_ids',
  'teacher_topk_logp',
)
# Fields whose padding value is not 0 (0 is a valid expert and task id).
_FILLED_ON_PAD = {'routed_experts': -1, 'old_experts': -1, 'task_id': -1}
# Padding rows repeat row 0's sampling parameters: a padding row must still
# be a valid row for the truncated-support rule.
_REPEATED_ON_PAD = ('temperature', 'top_k', 'top_p', 'min_p')


def padded_size(b: int, multiple: int) -> int:
  return -(-b // multiple) * multiple


def keep_rows(
  batch: RolloutBatch,
  trainer_version: int,
  max_staleness: int | None,
  policy: str = 'wait',
) -> tuple[np.ndarray, np.ndarray]:
  """(kept [B] bool, stale_dropped [B] bool): rows that train, and the ones
  dropped only for staleness: with `policy` 'wait' or 'drop' a row with any
  token staler than `max_staleness`, with 'mask' a row whose every token is
  (jaxcorr/train/rollouts/staleness.py)."""
  staleness_lib.check_policy(policy)
  finish = np.asarray(batch.finish_reason)
  live = ~np.isin(
    finish, [FinishReason.ABORT, FinishReason.ERROR, FinishReason.PAD]
  )
  stale_tok = staleness_lib.stale_tokens(batch, trainer_version, max_staleness)
  if policy == 'mask':
    fresh = np.asarray(batch.response_mask, bool) & ~stale_tok
    stale = stale_tok.any(1) & ~fresh.any(1)
  else:
    stale = stale_tok.any(1)
  return live & ~stale, live & stale


def keep_tokens(
  batch: RolloutBatch,
  trainer_version: int,
  max_staleness: int | None,
  policy: str = 'wait',
) -> np.ndarray:
  """[B, T] bool: the response tokens that train: those of the kept rows
  (`keep_rows`), less the stale ones with `policy='mask'`."""
  kept, _ = keep_rows(batch, trainer_version, max_staleness, policy)
  mask = np.asarray(batch.response_mask, bool) & kept[:, None]
  if policy == 'mask':
    mask &= ~staleness_lib.stale_tokens(batch, trainer_version, max_staleness)
  return mask


def overlong_shaping(
  batch: RolloutBatch, knobs: Any, max_len: int
) -> dict[str, np.ndarray]:
  """The overlong shaping of a batch by `knobs` (the `reward` section's
  overlong fields; jaxcorr/losses/overlong.py), as numpy `[B]` arrays:
  'truncated' (rows finished by LENGTH) when `mask_truncated_completions`,
  'penalty' (DAPO's, over the response-side tokens, the environment's
  included) when the buffer is enabled; neither when both are off."""
  out = {}
  if knobs.mask_truncated_completions:
    finish = np.asarray(batch.finish_reason)
    out['truncated'] = finish == FinishReason.LENGTH
  if knobs.overlong_buffer_enable:
    penalty = overlong_lib.overlong_penalty(
      np.asarray(batch.context_mask, bool),
      max_len=max_len,
      buffer_len=knobs.overlong_buffer_len,
      penalty_factor=knobs.overlong_penalty_factor,
    )
    out['penalty'] = np.asarray(penalty, np.float32)
  return out


def _overlong_fields(
  batch: RolloutBatch, seq_reward: np.ndarray, overlong: Any, max_len: int
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """The overlong shapings at assembly: a reward-time penalty added to
  `seq_reward`; the truncation flags and a loss-time penalty as the
  TrainBatch fields the update reads (`overlong` None: none)."""
  shaping = (
    {} if overlong is None else overlong_shaping(batch, overlong, max_len)
  )
  extra = {}
  if 'truncated' in shaping:
    extra['truncated'] = shaping['truncated']
  if 'penalty' in shaping:
    if overlong.overlong_penalty_at == 'reward':
      seq_reward = np.asarray(seq_reward, np.float32) + shaping['penalty']
    else:
      extra['overlong_penalty'] = shaping['penalty']
  return seq_reward, extra


def assemble(
  batch: RolloutBatch,
  seq_reward: np.ndarray,
  *,
  trainer_version: int,
  max_staleness: int | None,
  logprob_mode: str,
  row_multiple: int,
  staleness_policy: str = 'wait',
  overlong: Any = None,
  max_len: int = 0,
) -> TrainBatch:
  """The device batch as numpy arrays (see the module docstring), B rows
  rounded up to `row_multiple`; `overlong`: the `reward` section (its
  overlong fields; None: no shaping), `max_len` its L_max."""
  seq_reward, extra = _overlong_fields(batch, seq_reward, overlong, max_len)
  kept, _ = keep_rows(batch, trainer_version, max_staleness, staleness_policy)
  mask = keep_tokens(batch, trainer_version, max_staleness, staleness_policy)
  ctx = np.asarray(batch.context_mask, bool)
  kept_sets = {}
  if logprob_mode == 'replay':
    # μ: the engine's truncated value, which a replay engine renormalises
    # over the stored set ∪ {y} (rollout/decode.py `sample_rows`).
    kept_sets = {
      'kept_ids': np.where(mask[..., None], batch.kept_ids, -1),
      'kept_count': np.where(mask, batch.kept_count, 0),
    }
    kept_sets = {k: v.astype(np.int32) for k, v in kept_sets.items()}
  routing = {}
  name = 'rollout_logp'
  if logprob_mode in ('truncated', 'replay'):
    name = 'rollout_logp_truncated'
  mu = getattr(batch, name)
  if mu is None:
    raise ValueError(
      f'RolloutBatch.{name} is None with rollout.logprob_mode='
      f'{logprob_mode!r}: the rollout correction needs the per-token '
      'log-probs the engine sampled with (never zeros)'
    )
  mu = np.where(mask, np.asarray(mu), 0.0).astype(np.float32)
  tokens = np.concatenate(
    [np.asarray(batch.prompt_tokens), np.asarray(batch.response_tokens)], 1
  ).astype(np.int32)
  real = np.concatenate([np.asarray(batch.prompt_mask, bool), ctx], 1)
  tokens = np.where(real, tokens, 0)
  if batch.routed_experts is not None:
    routed = np.asarray(batch.routed_experts)
    routing['routed_experts'] = np.where(
      real[..., None, None], routed, -1
    ).astype(np.int32)
  out = TrainBatch(
    tokens=tokens,
    segment_ids=real.astype(np.int32),
    response_mask=mask,
    rollout_logp=mu,
    temperature=np.asarray(batch.temperature, np.float32),
    top_k=np.asarray(batch.top_k, np.int32),
    top_p=np.asarray(batch.top_p, np.float32),
    min_p=np.asarray(batch.min_p, np.float32),
    group_ids=np.asarray(batch.group_id, np.int32),
    seq_reward=np.where(kept, seq_reward, 0.0).astype(np.float32),
    version_gap=np.where(
      mask, staleness_lib.token_gap(batch, trainer_version), 0
    ).astype(np.int32),
    task_id=None
    if batch.task_id is None
    else np.asarray(batch.task_id, np.int32),
    **kept_sets,
    **routing,
    **extra,
  )
  return pad_rows(out, padded_size(batch.batch_size, row_multiple))


Batch = TypeVar('Batch')


def pad_rows(batch: Batch, rows: int) -> Batch:
  """Append PAD rows to a host batch dataclass up to `rows`: zeros, masks
  False, group id 0, and row 0's sampling parameters."""
  present = {
    f.name: getattr(batch, f.name)
    for f in dataclasses.fields(batch)
    if getattr(batch, f.name) is not None
  }
  b = next(iter(present.values())).shape[0]
  extra = rows - b
  if extra < 0:
    raise ValueError(f'cannot pad {b} rows down to {rows}')
  if extra == 0:
    return batch
  out = {}
  for name, x in present.items():
    if name in _REPEATED_ON_PAD:
      fill = np.broadcast_to(x[:1], (extra, *x.shape[1:]))
    else:
      fill = np.full(
        (extra, *x.shape[1:]), _FILLED_ON_PAD.get(name, 0), x.dtype
      )
    out[name] = np.concatenate([x, fill], 0)
  return batch.replace(**out)


def rollout_metrics(
  batch: RolloutBatch,
  seq_reward: np.ndarray,
  *,
  trainer_version: int,
  max_staleness: int | None,
  staleness_policy: str = 'wait',
  gap_buckets: int | None = None,
  overlong: Any = None,
  max_len: int = 0,
) -> Metrics:
  """`rollout/`, `reward/` and `response_length/` metrics of one batch,
  each with how it combines across processes (`reduction.py`); with
  `gap_buckets` (async and stream modes, `staleness.gap_buckets`) also the
  per-token `staleness.staleness_metrics`; with `overlong` (as `assemble`'s)
  the `overlong/` metrics. `reward/` is the score before the penalty."""
  kept, stale_dropped = keep_rows(
    batch, trainer_version, max_staleness, staleness_policy
  )
  finish = np.asarray(batch.finish_reason)
  real = finish != FinishReason.PAD
  n = max(int(real.sum()), 1)
  mask = np.asarray(batch.response_mask, bool)
  staleness = batch.staleness(trainer_version)[real]
  version = np.asarray(batch.policy_version)
  vmax = np.where(mask, version, -1).max(1)
  vmin = np.where(mask, version, np.iinfo(np.int32).max).min(1)
  mixed = mask.any(1) & (vmax != vmin)
  lengths = mask.sum(1)[real]
  r = np.asarray(seq_reward, np.float64)[real]
  avg, hi, lo = Metric.avg, Metric.max, Metric.min
  r_mean = float(r.mean()) if r.size else 0.0
  m = {
    'rollout/staleness_mean': avg(
      float(staleness.mean()) if staleness.size else 0.0
    ),
    'rollout/staleness_max': hi(
      float(staleness.max()) if staleness.size else 0
    ),
    'rollout/mixed_version_fraction': avg(float(mixed[real].sum() / n)),
    'rollout/stale_dropped_fraction': avg(float(stale_dropped.sum() / n)),
    'rollout/kept_fraction': avg(float(kept.sum() / n)),
    'reward/mean': avg(r_mean),
    'reward/std': Metric.std(float(r.std()) if r.size else 0.0, r_mean),
    'reward/max': hi(float(r.max()) if r.size else 0.0),
    'reward/min': lo(float(r.min()) if r.size else 0.0),
    'response_length/mean': avg(float(lengths.mean()) if lengths.size else 0.0),
    'response_length/max': hi(float(lengths.max()) if lengths.size else 0.0),
    'response_length/min': lo(float(lengths.min()) if lengths.size else 0.0),
  }
  for reason in ('stop', 'length', 'abort', 'error'):
    code = FinishReason[reason.upper()]
    m[f'rollout/finish_{reason}_fraction'] = avg(
      float((finish == code).sum() / n)
    )
  if gap_buckets is not None:
    trained = keep_tokens(
      batch, trainer_version, max_staleness, staleness_policy
    )
    m.update(
      staleness_lib.staleness_metrics(
        batch,
        trainer_version=trainer_version,
        real=real,
        trained=trained,
        buckets=gap_buckets,
      )
    )
  if batch.kept_count is not None:
    m.update(_replay_metrics(batch, mask & real[:, None]))
  if overlong is not None:
    shaping = overlong_shaping(batch, overlong, max_len)
    m.update(
      {f'overlong/{k}': avg(v) for k, v in _shaping_means(shaping, real)}
    )
  return m


def _shaping_means(shaping: dict[str, np.ndarray], real: np.ndarray):
  """(name, mean over the real rows) of the overlong shaping: the
  truncated rows the filter removes, the penalty and the penalised rows
  (verl's `overlong`)."""
  n = max(int(real.sum()), 1)
  if 'truncated' in shaping:
    yield (
      'masked_truncated_fraction',
      float(shaping['truncated'][real].sum() / n),
    )
  if 'penalty' in shaping:
    p = shaping['penalty'][real]
    yield 'penalty_mean', float(p.sum() / n)
    yield 'penalized_fraction', float((p < 0).sum() / n)


def _replay_metrics(batch: RolloutBatch, mask: np.ndarray) -> Metrics:
  """`replay/` metrics of a batch with kept sets (logprob_mode='replay'):
  the sampler's kept mass Z_t = μ_full(y) / μ_K(y) (the probability mass of
  K_t ∪ {y} under the engine's full distribution), the set sizes, and the
  fraction of tokens whose set was wider than the capacity."""
  full = np.asarray(batch.rollout_logp, np.float64)
  trunc = np.asarray(batch.rollout_logp_truncated, np.float64)
  z = np.exp(np.where(mask, full - trunc, 0.0))[mask]
  size = np.asarray(batch.kept_count, np.float64)[mask]
  capped = np.asarray(batch.kept_capped, bool)[mask]
  if not z.size:
    z = size = np.zeros(1)
    capped = np.zeros(1, bool)
  avg, hi, lo = Metric.avg, Metric.max, Metric.min
  return {
    'replay/kept_mass_mean': avg(float(z.mean())),
    'replay/kept_mass_min': lo(float(z.min())),
    'replay/set_size_mean': avg(float(size.mean())),
    'replay/set_size_max': hi(float(size.max())),
    'replay/capped_fraction': avg(float(capped.mean())),
  }


def to_device(mesh: Any, batch: Batch) -> Batch:
  """Process-local host rows -> global arrays sharded over the batch axes
  of `mesh` (every leaf; None fields stay None)."""
  multi = jax.process_count() > 1

  def put(x):
    sh = sharding.batch_sharding(mesh, x.ndim)
    if multi:
      return jax.make_array_from_process_local_data(sh, x)
    return jax.device_put(x, sh)

  return jax.tree.map(put, batch)
