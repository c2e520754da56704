"""Maps the reference frameworks' correction calls onto jaxcorr's.

Used by tests/helpers/correction_replay.py (the framework replays under
tests/conformance/) and tests/conformance/divergences/test_correction.py.
Each `*_call` function turns one golden case into `Call(train, rollout, mask,
cfg_kwargs)`; building `CorrectionConfig(**cfg_kwargs)` is left to the test, so
that an invalid reference configuration raises inside jaxcorr's own
validation, never inside this mapping. Values the mapping cannot interpret are
passed through unchanged for the same reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tests.helpers import golden_data


@dataclasses.dataclass
class Call:
  """One `rollout_correction(train, rollout, mask, cfg)` call."""

  train: np.ndarray | None
  rollout: np.ndarray | None
  mask: np.ndarray | None
  cfg: dict[str, Any]


def _num_or_text(text: str) -> Any:
  try:
    return float(text)
  except ValueError:
    return text


# ------------------------------------------------------------------ verl


def verl_is_fields(level: Any, threshold: Any, batch_norm: Any) -> dict:
  """verl `rollout_is*` arguments → `is_*` fields.

  A float (or a plain numeric string) is a TIS cap (`truncate`); a
  `'lo_up'` string is IcePop (`mask` with both bounds).
  """
  fields: dict[str, Any] = {'is_level': level}
  if batch_norm:
    fields['is_batch_normalize'] = batch_norm
  if level is None:
    return fields
  if isinstance(threshold, str) and '_' in threshold:
    lo, up = threshold.split('_', 1)
    fields.update(
      is_mode='mask', is_lower=_num_or_text(lo), is_upper=_num_or_text(up)
    )
  elif isinstance(threshold, str):
    fields.update(is_mode='truncate', is_upper=_num_or_text(threshold))
  else:
    fields.update(is_mode='truncate', is_upper=threshold)
  return fields


def invert_k1_bounds(rs: Any, bounds: Any) -> Any:
  """verl's k1 band `(lo, up)` on π_rollout/π_train as a band on ρ (D1).

  verl keeps `lo ≤ 1/ρ ≤ up`, i.e. `1/up ≤ ρ ≤ 1/lo`: the jaxcorr config that
  reproduces verl's verdicts. Non-k1 entries are returned unchanged.
  """
  names = [s.strip() for s in rs.split(',')]
  entries = [s.strip() for s in str(bounds).split(',')]
  if len(entries) not in (1, len(names)):
    return bounds  # invalid: left for CorrectionConfig to reject
  if len(entries) == 1:
    entries = entries * len(names)
  out = []
  for name, entry in zip(names, entries):
    if not name.endswith('_k1'):
      out.append(entry)
      continue
    if '_' in entry:
      lo, up = (float(x) for x in entry.split('_', 1))
    else:
      up = float(entry)
      lo = 1.0 / up
    out.append((1.0 / up, 1.0 / lo))
  return tuple(out)


def verl_asymmetric_k1(rs: Any, bounds: Any) -> bool:
  """True when some k1 criterion has `lo ≠ 1/up` (where D1 can show)."""
  if not rs or bounds is None:
    return False
  names = [s.strip() for s in rs.split(',')]
  entries = [s.strip() for s in str(bounds).split(',')]
  if len(entries) == 1:
    entries = entries * len(names)
  for name, entry in zip(names, entries):
    if name.endswith('_k1') and '_' in entry:
      lo, up = (float(x) for x in entry.split('_', 1))
      if lo != 1.0 / up:
        return True
  return False


def _verl_arrays(gs, kw: dict) -> tuple:
  data = gs.dataset()
  train = kw.get('old_log_prob')
  rollout = kw.get('rollout_log_prob')
  mask = kw.get('response_mask')
  if isinstance(mask, str):  # 'zeros(B,T)'
    assert mask == 'zeros(B,T)', mask
    mask = np.zeros_like(data['response_mask'])
  if isinstance(rollout, str):  # 'rollout_log_prob[:, :-1]'
    assert rollout == 'rollout_log_prob[:, :-1]', rollout
    rollout = data['rollout_log_prob'][:, :-1]
  if train is None:
    train = data['old_log_prob']
  if 'rollout_log_prob' not in kw:
    rollout = data['rollout_log_prob']
  if mask is None:
    mask = data['response_mask']
  return train, rollout, mask


def _preset_mode(case_id: str) -> dict:
  """Mode fields of a verl preset, from its name (bypass_pg_* = reinforce)."""
  name = case_id.split('/')[1]
  if name.startswith('bypass_pg'):
    return {'mode': 'bypass', 'bypass_loss': 'reinforce'}
  if name.startswith('bypass'):
    return {'mode': 'bypass', 'bypass_loss': 'ppo_clip'}
  return {}


def verl_call(gs, case: dict, *, verl_k1: bool = False) -> Call:
  """verl `rollout_corr_helper` case → jaxcorr call.

  Args:
    gs: the verl GoldenSet.
    case: a case of the correction groups.
    verl_k1: translate k1 bounds with `invert_k1_bounds` (reproduces verl's
      inverted band, D1) instead of passing them through.
  """
  kw = gs.kwargs(case)
  fn = case['function'].rsplit('.', 1)[1]
  legacy = case['group'] == 'legacy'
  if fn == 'compute_rollout_correction_and_add_to_batch':
    c = kw['rollout_corr_config']
    batch = kw['batch']
    args = (batch['old_log_probs'], batch['rollout_log_probs'])
    mask = batch['response_mask']
    cfg = verl_is_fields(
      c['rollout_is'],
      c['rollout_is_threshold'],
      c['rollout_is_batch_normalize'],
    )
    if c['bypass_mode']:
      cfg.update(mode='bypass', bypass_loss=c['loss_type'])
    rs, bounds = c['rollout_rs'], c['rollout_rs_threshold']
  elif fn == 'compute_rollout_correction_weights':  # is_direct
    assert kw['log_ratio'] == 'old_log_prob - rollout_log_prob'
    data = gs.dataset()
    args = (data['old_log_prob'], data['rollout_log_prob'])
    mask = kw['response_mask']
    cfg = verl_is_fields(
      kw['rollout_is'],
      kw['rollout_is_threshold'],
      kw['rollout_is_batch_normalize'],
    )
    rs = bounds = None
  elif fn in (
    'compute_offpolicy_metrics',
    'compute_rollout_corr_metrics_from_logprobs',
  ):
    train = kw.get('old_log_prob', kw.get('log_prob'))
    return Call(train, kw['rollout_log_prob'], kw['response_mask'], {})
  elif legacy:
    return legacy_call(gs, case)
  else:  # compute_rollout_correction_and_rejection_mask
    train, rollout, mask = _verl_arrays(gs, kw)
    args = (train, rollout)
    cfg = verl_is_fields(
      kw.get('rollout_is'),
      kw.get('rollout_is_threshold'),
      kw.get('rollout_is_batch_normalize', False),
    )
    cfg.update(_preset_mode(case['id']) if case['group'] == 'preset' else {})
    rs, bounds = kw.get('rollout_rs'), kw.get('rollout_rs_threshold')
  if rs is not None:
    cfg['rs'] = rs
    cfg['rs_bounds'] = bounds
    if verl_k1 and isinstance(rs, str) and rs.strip(', '):
      cfg['rs_bounds'] = invert_k1_bounds(rs, bounds)
  return Call(args[0], args[1], mask, cfg)


def legacy_call(gs, case: dict) -> Call:
  """verl legacy helper (`9b718e1a7`) → jaxcorr call.

  Legacy RS `token` / `sequence` / `geometric` bound the token ratio, the
  sequence product ratio and the geometric-mean ratio (ρ = π_old/π_rollout,
  the IS direction) to `[lower, upper]`, `lower` defaulting to `1/upper`:
  `token_k1`, `seq_sum_k1`, `seq_mean_k1`. The token veto is `veto_low`.
  """
  kw = gs.kwargs(case)
  train, rollout, mask = _verl_arrays(gs, kw)
  cfg = verl_is_fields(
    kw.get('rollout_is'),
    kw.get('rollout_is_threshold', 2.0),
    kw.get('rollout_is_batch_normalize', False),
  )
  rs = kw.get('rollout_rs')
  if rs is not None:
    cfg['rs'] = ({'token': 'token_k1', 'sequence': 'seq_sum_k1'}).get(
      rs, 'seq_mean_k1' if rs == 'geometric' else rs
    )
    up, lo = (
      kw.get('rollout_rs_threshold'),
      kw.get('rollout_rs_threshold_lower'),
    )
    cfg['rs_bounds'] = (up if lo is None else (lo, up),)
  if 'rollout_token_veto_threshold' in kw:
    cfg['veto_low'] = kw['rollout_token_veto_threshold']
  return Call(train, rollout, mask, cfg)


# ----------------------------------------------------------------- SkyRL


def skyrl_cfg(opc: dict) -> dict:
  """SkyRL `OffPolicyCorrectionConfig` → `CorrectionConfig` fields.

  tis_ratio_type → token/sequence truncate with its own cap;
  sequence_mask_metric geometric / product → `seq_mean_k1` / `seq_sum_k1`
  with the geo / product band; the outlier thresholds → `veto_low` /
  `veto_high`; the token mask (only when both bounds are set, as in SkyRL)
  → `token_k1`.
  """
  cfg: dict[str, Any] = {}
  tis = opc['tis_ratio_type']
  if tis == 'token':
    cfg.update(is_level='token', is_upper=opc['token_tis_ratio_clip_high'])
  elif tis == 'sequence':
    cfg.update(
      is_level='sequence', is_upper=opc['sequence_tis_ratio_clip_high']
    )
  rs, bounds = [], []
  lo, hi = (
    opc['token_mask_is_threshold_low'],
    opc['token_mask_is_threshold_high'],
  )
  if lo is not None and hi is not None:
    rs.append('token_k1')
    bounds.append((lo, hi))
  metric = opc['sequence_mask_metric']
  if metric == 'geometric':
    rs.append('seq_mean_k1')
    bounds.append((opc['geo_mask_low'], opc['geo_mask_high']))
  elif metric == 'product':
    rs.append('seq_sum_k1')
    bounds.append((opc['product_mask_low'], opc['product_mask_high']))
  if rs:
    cfg.update(rs=tuple(rs), rs_bounds=tuple(bounds))
  if opc['outlier_token_is_threshold_low'] is not None:
    cfg['veto_low'] = opc['outlier_token_is_threshold_low']
  if opc['outlier_token_is_threshold_high'] is not None:
    cfg['veto_high'] = opc['outlier_token_is_threshold_high']
  return cfg


def skyrl_call(gs, case: dict) -> Call:
  kw = gs.kwargs(case)
  opc = dict(kw['off_policy_correction'])
  return Call(
    kw['old_log_probs'],
    kw.get('rollout_logprobs'),
    kw['loss_mask'] > 0,
    skyrl_cfg(opc),
  )


# ----------------------------------------------------------------- slime


def unpack(flat: np.ndarray, lengths, t: int, fill: float) -> np.ndarray:
  """slime's packed `flat` (row i = `lengths[i]` tokens) → `[B, T]`."""
  out = np.full((len(lengths), t), fill, dtype=flat.dtype)
  starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
  for i, (s, n) in enumerate(zip(starts, lengths)):
    out[i, :n] = flat[s : s + n]
  return out


def slime_layout(gs) -> tuple[np.ndarray, int]:
  ds = gs.index['datasets']['main']
  return np.asarray(ds['batch']['lengths']), ds['T']


def slime_mis_cfg(kw: dict) -> dict:
  """slime `compute_mis_weights` arguments → `CorrectionConfig` fields.

  RS bounds default to the TIS bounds (slime), `rs_level` token / sequence /
  geometric → `token_k1` / `seq_sum_k1` / `seq_mean_k1`, the veto →
  `veto_low`.
  """
  cfg: dict[str, Any] = {}
  if kw['use_tis']:
    cfg.update(
      is_level=kw['tis_level'],
      is_mode=kw['tis_mode'],
      is_upper=kw['tis_upper_bound'],
      is_lower=kw['tis_lower_bound'],
      is_batch_normalize=kw['tis_batch_normalize'],
    )
  if kw['use_rs']:
    up = kw['rs_upper_bound']
    lo = kw['rs_lower_bound']
    if up is None:
      up = kw['tis_upper_bound']
    if lo is None:
      lo = kw['tis_lower_bound']
    name = {
      'token': 'token_k1',
      'sequence': 'seq_sum_k1',
      'geometric': 'seq_mean_k1',
    }[kw['rs_level']]
    cfg.update(rs=(name,), rs_bounds=((lo, up),))
  if kw['rs_veto_threshold'] is not None:
    cfg['veto_low'] = kw['rs_veto_threshold']
  return cfg


def slime_call(gs, case: dict, fill: float = np.nan) -> Call:
  """slime packed case → `[B, T]` call; padding filled with `fill`."""
  kw = gs.kwargs(case)
  lengths, t = slime_layout(gs)
  train = unpack(kw['train_log_probs'], lengths, t, fill)
  rollout = unpack(kw['rollout_log_probs'], lengths, t, fill)
  mask = unpack(kw['loss_masks'], lengths, t, 0) > 0
  if case['group'] == 'tis':
    lo, hi = kw['tis_clip_low'], kw['tis_clip']
    icepop = case['id'].startswith('tis/icepop')
    if icepop:
      # [0, hi]: every ratio passes the lower bound; the smallest positive
      # Cl does the same (ρ ≥ e^-20 after the safety bound).
      cfg = dict(
        is_level='token', is_mode='mask', is_upper=hi, is_lower=lo or 1e-30
      )
    elif lo == 0:
      cfg = dict(is_level='token', is_mode='truncate', is_upper=hi)
    else:
      cfg = dict(is_level='token', is_mode='clip', is_upper=hi, is_lower=lo)
    return Call(train, rollout, mask, cfg)
  return Call(train, rollout, mask, slime_mis_cfg(kw))


def slime_rows(gs, flat: np.ndarray) -> np.ndarray:
  """Packed per-token output → `[B, T]` (zeros in padding)."""
  lengths, t = slime_layout(gs)
  return unpack(np.asarray(flat), lengths, t, 0)


def load(fw: str):
  return golden_data.load(fw)
