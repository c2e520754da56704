"""Host-side checks of a `RolloutBatch` before it goes to the device
(`docs/math/rollout_contract.md` §7).

Every failure is a `ValueError` naming the field, the first rows concerned
and the rule, so a broken engine adapter is caught at the boundary instead
of biasing importance ratios downstream.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxcorr.rollout.types import FinishReason, RolloutBatch

_LOGP_TOL = 1e-6
LOGPROB_MODES = ('full', 'truncated', 'replay')


@dataclasses.dataclass(frozen=True)
class ValidationConfig:
  """The sampling and rollout settings a batch is checked against."""

  vocab_size: int
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  samples_per_prompt: int = 1
  needs_rollout_logp: bool = True
  logprob_mode: str = 'full'  # 'full' | 'truncated' | 'replay'
  # 'replay': at most this fraction of valid tokens may have a kept set
  # wider than the fixed width C (rollout/kept_set.py).
  max_capped_fraction: float = 0.01
  allow_nonfinite_logp: bool = False
  trainer_version: int | None = None  # None: no upper bound check
  # MoE policy: (L_moe, k, E) of its routing; None for a dense policy.
  routing: tuple[int, int, int] | None = None
  needs_routing: bool = False  # moe.router_replay='rollout'

  @property
  def truncation(self) -> bool:
    return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def _fail(field: str, rows: np.ndarray, rule: str):
  rows = np.flatnonzero(rows)
  if rows.size:
    raise ValueError(
      f'RolloutBatch.{field}: rows {rows[:5].tolist()} '
      f'({rows.size} in all) violate: {rule}'
    )


def _check_array(batch, name, shape, kind):
  x = getattr(batch, name)
  if x is None:
    raise ValueError(f'RolloutBatch.{name}: missing (rule: required field)')
  x = np.asarray(x)
  if x.shape != shape or x.dtype != np.dtype(kind):
    raise ValueError(
      f'RolloutBatch.{name}: shape {x.shape} dtype {x.dtype}, expected '
      f'{shape} {np.dtype(kind)} '
      '(rule: the layout of docs/math/rollout_contract.md §4)'
    )
  return x


def validate_rollout_batch(batch: RolloutBatch, cfg: ValidationConfig):
  """Raise ValueError on the first violated rule of
  docs/math/rollout_contract.md §7; return None."""
  b, t = np.shape(batch.response_tokens)
  p = np.shape(batch.prompt_tokens)[1]
  bt, bp = (b, t), (b, p)
  a = {
    name: _check_array(batch, name, shape, kind)
    for name, shape, kind in [
      ('prompt_tokens', bp, np.int32),
      ('prompt_mask', bp, np.bool_),
      ('response_tokens', bt, np.int32),
      ('context_mask', bt, np.bool_),
      ('response_mask', bt, np.bool_),
      ('temperature', (b,), np.float32),
      ('top_k', (b,), np.int32),
      ('top_p', (b,), np.float32),
      ('min_p', (b,), np.float32),
      ('policy_version', bt, np.int32),
      ('finish_reason', (b,), np.int8),
      ('group_id', (b,), np.int32),
      ('sample_id', (b,), np.int32),
    ]
  }
  mask = a['response_mask']
  _fail(
    'finish_reason',
    ~np.isin(a['finish_reason'], [int(r) for r in FinishReason]),
    'a valid FinishReason value',
  )
  pad = a['finish_reason'] == FinishReason.PAD
  _check_masks(a, pad)
  _check_logprobs(batch, cfg, mask, (b, t))
  _check_sampling_and_groups(a, cfg, pad, b)
  _check_versions_and_ids(a, cfg)
  # 9. Replay: the engine's kept sets (rollout/kept_set.py).
  if cfg.logprob_mode == 'replay':
    _check_replay(batch, cfg, a['response_tokens'], mask)
  # 10. MoE routing (docs/moe.md).
  if cfg.routing is not None and (
    cfg.needs_routing or batch.routed_experts is not None
  ):
    real = np.concatenate([a['prompt_mask'], a['context_mask']], 1)
    validate_routing(batch.routed_experts, real, cfg.routing)


def validate_routing(
  routed: np.ndarray | None, real: np.ndarray, routing: tuple[int, int, int]
) -> None:
  """`RolloutBatch.routed_experts` [B, P + T, L_moe, k] int32: ids in
  [0, E), distinct per (token, layer), on every real position but each
  row's last; -1 everywhere else."""
  layers, k, e = routing
  if routed is None:
    raise ValueError(
      "RolloutBatch.routed_experts: missing (rule: moe.router_replay='rollout' "
      'replays the routing the engine records for MoE policies)'
    )
  b, s = real.shape
  x = _check_shape('routed_experts', routed, (b, s, layers, k), np.int32)
  _fail(
    'routed_experts', ((x < -1) | (x >= e)).any((1, 2, 3)), f'ids in [-1, {e})'
  )
  last = s - 1 - np.argmax(real[:, ::-1], axis=1)
  fed = real & (np.arange(s)[None] != last[:, None])
  unset = (x == -1).all(-1)  # [B, S, L]
  _fail(
    'routed_experts',
    (fed[..., None] & (x < 0).any(-1)).any((1, 2)),
    'every fed token (real, not the last) has k experts in every MoE layer',
  )
  _fail(
    'routed_experts',
    (~real[..., None] & ~unset).any((1, 2)),
    '-1 on padding positions',
  )
  srt = np.sort(x, -1)
  dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
  _fail('routed_experts', dup.any((1, 2, 3)), 'k distinct experts per layer')


def _check_masks(a: dict[str, np.ndarray], pad: np.ndarray) -> None:
  """Rule 2: the masks nest, PAD rows are empty, real rows have a prompt."""
  mask, ctx = a['response_mask'], a['context_mask']
  _fail('response_mask', (mask & ~ctx).any(1), 'response_mask ⊆ context_mask')
  pad_masks = a['prompt_mask'].any(1) | ctx.any(1) | mask.any(1)
  _fail('prompt_mask', pad & pad_masks, 'PAD rows have all masks False')
  _fail(
    'prompt_mask',
    ~pad & ~a['prompt_mask'].any(1),
    'every non-PAD row has a prompt token',
  )


def _check_logprobs(
  batch: RolloutBatch,
  cfg: ValidationConfig,
  mask: np.ndarray,
  bt: tuple[int, int],
) -> None:
  """Rules 3-5: the log-probs the configured mode needs, finite and <= 0."""
  logp = None
  if cfg.logprob_mode not in LOGPROB_MODES:
    raise ValueError(
      f'ValidationConfig.logprob_mode={cfg.logprob_mode!r}; allowed: '
      + ', '.join(repr(m) for m in LOGPROB_MODES)
    )
  if cfg.needs_rollout_logp or cfg.logprob_mode != 'full':
    logp = _check_array(batch, 'rollout_logp', bt, np.float32)
    if not cfg.allow_nonfinite_logp:
      _fail(
        'rollout_logp',
        (mask & ~np.isfinite(logp)).any(1),
        'finite on response_mask',
      )
    _fail(
      'rollout_logp',
      (mask & (logp > _LOGP_TOL)).any(1),
      f'<= {_LOGP_TOL} on response_mask (a positive log-prob means a '
      'wrong definition)',
    )
    _check_not_zeros(logp, mask, cfg)
  if cfg.truncation or cfg.logprob_mode == 'truncated':
    trunc = _check_array(batch, 'rollout_logp_truncated', bt, np.float32)
    _fail(
      'rollout_logp_truncated',
      (mask & ~np.isfinite(trunc)).any(1),
      'finite on response_mask',
    )
    if logp is not None:
      _fail(
        'rollout_logp_truncated',
        (mask & (trunc < logp - _LOGP_TOL)).any(1),
        '>= rollout_logp - 1e-6 on response_mask',
      )


def _check_not_zeros(
  logp: np.ndarray, mask: np.ndarray, cfg: ValidationConfig
) -> None:
  """Rule 3: log-probs exactly 0.0 on every response token of a sampled
  batch (τ > 0, top_k != 1) are an engine that returned none, not a policy
  sure of every token: the correction would read μ = 1 everywhere."""
  n = int(mask.sum())
  if cfg.top_k == 1 or n == 0 or (logp[mask] != 0).any():
    return
  raise ValueError(
    f'RolloutBatch.rollout_logp: rollout log-probs look missing (all zeros '
    f'on the {n} response tokens of a sampled batch, temperature='
    f'{cfg.temperature}, top_k={cfg.top_k}): the engine must return '
    'per-token log-probs of the sampled tokens (greedy decoding, where 0 is '
    'right, is top_k=1)'
  )


def _check_sampling_and_groups(
  a: dict[str, np.ndarray], cfg: ValidationConfig, pad: np.ndarray, b: int
) -> None:
  """Rules 6-7: sampling parameters as configured; groups in range and no
  larger than samples_per_prompt."""
  for name in ('temperature', 'top_k', 'top_p', 'min_p'):
    want = getattr(cfg, name)
    _fail(name, ~pad & (a[name] != want), f'equals the configured {want}')
  _fail('temperature', a['temperature'] <= 0, 'τ > 0')
  # 7. Groups.
  gid = a['group_id']
  _fail('group_id', (gid < 0) | (gid >= b), f'group_id in [0, {b})')
  live = ~pad & (a['finish_reason'] != FinishReason.ABORT)
  live &= a['finish_reason'] != FinishReason.ERROR
  counts = np.bincount(gid[~pad], minlength=b)
  _fail(
    'group_id',
    live & (counts[np.clip(gid, 0, b - 1)] > cfg.samples_per_prompt),
    f'at most samples_per_prompt={cfg.samples_per_prompt} members per group',
  )


def _check_versions_and_ids(
  a: dict[str, np.ndarray], cfg: ValidationConfig
) -> None:
  """Rule 8: policy versions in range; token ids inside the vocabulary."""
  mask, ctx = a['response_mask'], a['context_mask']
  ver = a['policy_version']
  bad_ver = mask & (ver < 0)
  if cfg.trainer_version is not None:
    bad_ver |= mask & (ver > cfg.trainer_version)
  _fail('policy_version', bad_ver.any(1), '0 <= version <= trainer_version')
  for name, m in (
    ('prompt_tokens', a['prompt_mask']),
    ('response_tokens', ctx),
  ):
    tok = a[name]
    _fail(
      name,
      (m & ((tok < 0) | (tok >= cfg.vocab_size))).any(1),
      f'token ids in [0, {cfg.vocab_size})',
    )


def _check_replay(batch, cfg, response_tokens, mask):
  kept = {}
  for name in ('kept_ids', 'kept_count', 'kept_capped'):
    kept[name] = getattr(batch, name, None)
    if kept[name] is None:
      raise ValueError(
        f"RolloutBatch.{name}: missing (rule: logprob_mode='replay' "
        'needs the kept set of every response token from the engine)'
      )
  validate_kept_set(
    **kept,
    response_tokens=response_tokens,
    response_mask=mask,
    vocab_size=cfg.vocab_size,
    max_capped_fraction=cfg.max_capped_fraction,
  )


def validate_kept_set(
  kept_ids: np.ndarray,
  kept_count: np.ndarray,
  kept_capped: np.ndarray,
  response_tokens: np.ndarray,
  response_mask: np.ndarray,
  vocab_size: int,
  max_capped_fraction: float = 0.01,
) -> None:
  """Rules of the replay kept sets (`KeptSet`: ids `[B, T, C]` int32,
  count `[B, T]` int32, capped `[B, T]` bool), on valid tokens:

  * 1 ≤ count ≤ C (the sampled token was drawn from a non-empty set);
  * the first `count` ids lie in [0, V) and are distinct; the rest are -1;
  * capped ⇒ count = C;
  * the sampled token is in its set unless the set was capped;
  * at most `max_capped_fraction` of the valid tokens are capped.

  slime drops ids outside [0, V), ignores duplicates, force-keeps a missing
  sampled token and falls back to the full vocabulary where data is
  missing; here each is an error (D27 in docs/correction.md).
  """
  mask = np.asarray(response_mask, bool)
  b, t = mask.shape
  ids = np.asarray(kept_ids)
  if ids.ndim != 3 or ids.shape[:2] != (b, t) or ids.dtype != np.int32:
    raise ValueError(
      f'RolloutBatch.kept_ids: shape {ids.shape} dtype {ids.dtype}, expected '
      f'({b}, {t}, C) int32 (rule: replay layout)'
    )
  count = _check_shape('kept_count', kept_count, (b, t), np.int32)
  capped = _check_shape('kept_capped', kept_capped, (b, t), np.bool_)
  c = ids.shape[2]
  _fail(
    'kept_count',
    (mask & ((count < 1) | (count > c))).any(1),
    f'1 <= kept_count <= C={c} on response_mask',
  )
  live = np.arange(c) < count[..., None]
  bad = live & ((ids < 0) | (ids >= vocab_size))
  bad |= ~live & (ids != -1)
  _fail(
    'kept_ids',
    (mask[..., None] & bad).any((1, 2)),
    f'the first kept_count ids in [0, {vocab_size}), the rest -1',
  )
  srt = np.sort(np.where(live, ids, -1), axis=-1)
  dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
  _fail('kept_ids', (mask[..., None] & dup).any((1, 2)), 'distinct ids')
  _fail(
    'kept_capped',
    (mask & capped & (count != c)).any(1),
    'capped only when kept_count == C',
  )
  tok = np.asarray(response_tokens)[..., None]
  has_y = (live & (ids == tok)).any(-1)
  _fail(
    'kept_ids',
    (mask & ~capped & ~has_y).any(1),
    'the sampled token is in its kept set (unless capped)',
  )
  n = max(int(mask.sum()), 1)
  frac = float((mask & capped).sum()) / n
  if frac > max_capped_fraction:
    raise ValueError(
      f'RolloutBatch.kept_capped: {frac:.3%} of the valid tokens have a kept '
      f'set wider than C={c}; allowed: at most max_capped_fraction='
      f"{max_capped_fraction} (raise the engine's kept-set capacity)"
    )


def _check_shape(name, x, shape, kind):
  x = np.asarray(x)
  if x.shape != shape or x.dtype != np.dtype(kind):
    raise ValueError(
      f'RolloutBatch.{name}: shape {x.shape} dtype {x.dtype}, expected '
      f'{shape} {np.dtype(kind)} (rule: replay layout)'
    )
  return x
