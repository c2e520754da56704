"""Host side of a step: `RolloutBatch` + rewards -> the trainer's arrays.

`assemble` runs in numpy after validation and before the one transfer to the
devices. It

* drops rows the contract says to drop (docs/math/rollout_contract.md §6): ABORT
  and ERROR rows and rows staler than `rollout.max_staleness` become empty rows
  (every mask False);
* picks μ by `rollout.logprob_mode` (`rollout_logp` or its truncated value);
* lays prompt and response out as one `[B, P + T]` token row with segment
  ids (1 on real tokens) so positions count from the first real prompt token
  in the trainer exactly as in the engine (docs/math/rollout_contract.md §3);
* pads the batch with complete PAD rows up to a multiple of `row_multiple`
  (mini-batches x micro-batches x the mesh's batch shards). A padding row
  carries every per-token field, `rollout_logp` included, as zeros with the
  mask off (docs/math/rollout_contract.md §5; SkyRL once dropped `rollout_logp`
  from padding micro-batches). Losses and metrics are identical with and without
  them.

`rollout_metrics` computes the `rollout/` metrics of
docs/math/rollout_contract.md §6 on the host, where the versions and finish
reasons already are.
"""

from __future__ import annotations

import numpy as np

from jaxcorr.rollout.types import FinishReason, RolloutBatch

# Fields of the device batch, with their per-row shape suffix and dtype.
TOKEN_FIELDS = ('tokens', 'segment_ids')
RESPONSE_FIELDS = ('response_mask', 'rollout_logp')
ROW_FIELDS = (
  'temperature',
  'top_k',
  'top_p',
  'min_p',
  'group_ids',
  'seq_reward',
)


def padded_size(b: int, multiple: int) -> int:
  return -(-b // multiple) * multiple


def keep_rows(
  batch: RolloutBatch, trainer_version: int, max_staleness: int | None
) -> tuple[np.ndarray, np.ndarray]:
  """(kept [B] bool, stale_dropped [B] bool): rows that train, and the ones
  dropped only for staleness."""
  finish = np.asarray(batch.finish_reason)
  live = ~np.isin(
    finish, [FinishReason.ABORT, FinishReason.ERROR, FinishReason.PAD]
  )
  stale = np.zeros_like(live)
  if max_staleness is not None:
    stale = batch.staleness(trainer_version) > max_staleness
  return live & ~stale, live & stale


def assemble(
  batch: RolloutBatch,
  seq_reward: np.ndarray,
  *,
  trainer_version: int,
  max_staleness: int | None,
  logprob_mode: str,
  row_multiple: int,
) -> dict[str, np.ndarray]:
  """The device batch as numpy arrays (see the module docstring).

  Returns a dict with `tokens`, `segment_ids` `[B', P + T]` int32,
  `response_mask` `[B', T]` bool, `rollout_logp` `[B', T]` float32 (μ),
  and `[B']` `temperature`, `top_k`, `top_p`, `min_p`, `group_ids`,
  `seq_reward`, where B' is B rounded up to `row_multiple`.
  """
  b, t = np.shape(batch.response_tokens)
  kept, _ = keep_rows(batch, trainer_version, max_staleness)
  mask = np.asarray(batch.response_mask, bool) & kept[:, None]
  ctx = np.asarray(batch.context_mask, bool)
  if logprob_mode == 'truncated':
    mu = batch.rollout_logp_truncated
  else:
    mu = batch.rollout_logp
  mu = np.zeros((b, t), np.float32) if mu is None else np.asarray(mu)
  mu = np.where(mask, mu, 0.0).astype(np.float32)
  tokens = np.concatenate(
    [np.asarray(batch.prompt_tokens), np.asarray(batch.response_tokens)], 1
  ).astype(np.int32)
  real = np.concatenate([np.asarray(batch.prompt_mask, bool), ctx], 1)
  tokens = np.where(real, tokens, 0)
  out = {
    'tokens': tokens,
    'segment_ids': real.astype(np.int32),
    'response_mask': mask,
    'rollout_logp': mu,
    'temperature': np.asarray(batch.temperature, np.float32),
    'top_k': np.asarray(batch.top_k, np.int32),
    'top_p': np.asarray(batch.top_p, np.float32),
    'min_p': np.asarray(batch.min_p, np.float32),
    'group_ids': np.asarray(batch.group_id, np.int32),
    'seq_reward': np.where(kept, seq_reward, 0.0).astype(np.float32),
  }
  return pad_rows(out, padded_size(b, row_multiple))


def pad_rows(arrays: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
  """Append PAD rows up to `rows`: zeros, masks False, sampling params of
  row 0 (a padding row must still be a valid row), group id 0."""
  b = next(iter(arrays.values())).shape[0]
  extra = rows - b
  if extra < 0:
    raise ValueError(f'cannot pad {b} rows down to {rows}')
  if extra == 0:
    return arrays
  out = {}
  for name, x in arrays.items():
    if name in ('temperature', 'top_k', 'top_p', 'min_p'):
      fill = np.broadcast_to(x[:1], (extra, *x.shape[1:]))
    else:
      fill = np.zeros((extra, *x.shape[1:]), x.dtype)
    out[name] = np.concatenate([x, fill], 0)
  return out


def rollout_metrics(
  batch: RolloutBatch,
  seq_reward: np.ndarray,
  *,
  trainer_version: int,
  max_staleness: int | None,
) -> dict[str, float]:
  """`rollout/`, `reward/` and `response_length/` metrics of one batch."""
  kept, stale_dropped = keep_rows(batch, trainer_version, max_staleness)
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
  m = {
    'rollout/staleness_mean': (
      float(staleness.mean()) if staleness.size else 0.0
    ),
    'rollout/staleness_max': float(staleness.max()) if staleness.size else 0,
    'rollout/mixed_version_fraction': float(mixed[real].sum() / n),
    'rollout/stale_dropped_fraction': float(stale_dropped.sum() / n),
    'rollout/kept_fraction': float(kept.sum() / n),
    'reward/mean': float(r.mean()) if r.size else 0.0,
    'reward/std': float(r.std()) if r.size else 0.0,
    'reward/max': float(r.max()) if r.size else 0.0,
    'reward/min': float(r.min()) if r.size else 0.0,
    'response_length/mean': float(lengths.mean()) if lengths.size else 0.0,
    'response_length/max': float(lengths.max()) if lengths.size else 0.0,
    'response_length/min': float(lengths.min()) if lengths.size else 0.0,
  }
  for reason in ('stop', 'length', 'abort', 'error'):
    code = FinishReason[reason.upper()]
    m[f'rollout/finish_{reason}_fraction'] = float((finish == code).sum() / n)
  return m
