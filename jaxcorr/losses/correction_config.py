"""`CorrectionConfig`: the rollout-correction settings (spec correction.md §3).

A frozen, hashable dataclass (a static jit argument) validated on
construction. It stores a canonical form: `rs` a tuple of criterion names,
`rs_bounds` one `(lo, up)` pair per criterion (`lo=None` for k2/k3). verl's
comma-separated strings and ml-collections lists are accepted. Every invalid
value raises a `ValueError` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NoReturn

from jaxcorr.losses import masked

MODES = ('decoupled', 'bypass')
BYPASS_LOSSES = ('ppo_clip', 'reinforce')
IS_LEVELS = ('token', 'sequence', 'geometric')
IS_MODES = ('truncate', 'clip', 'mask')
RS_CRITERIA = (
  'token_k1',
  'token_k2',
  'token_k3',
  'seq_sum_k1',
  'seq_sum_k2',
  'seq_sum_k3',
  'seq_mean_k1',
  'seq_mean_k2',
  'seq_mean_k3',
  'seq_max_k2',
  'seq_max_k3',
  # KPop (AReaL): max of the two Bernoulli KLs, correction_reject.py.
  'token_bkl',
  'seq_sum_bkl',
  'seq_mean_bkl',
  'seq_max_bkl',
)
LEGACY_RS_NAMES = {
  'token': 'token_k1',
  'sequence': 'seq_sum_k1',
  'geometric': 'seq_mean_k1',
}
"""verl's pre-k1 names, rejected with a hint to their replacement."""


# ------------------------------------------------------------------ config


def _fail(field: str, value: Any, allowed: str, why: str = '') -> NoReturn:
  why = f' ({why})' if why else ''
  raise ValueError(
    f'CorrectionConfig.{field}: invalid value {value!r}{why}; '
    f'allowed: {allowed}'
  )


def _choice(field: str, value: Any, allowed: tuple, optional: bool = False):
  names = ', '.join(repr(a) for a in allowed)
  if optional:
    names += ' or None'
  if value is None and optional:
    return None
  if not isinstance(value, str) or value not in allowed:
    _fail(field, value, names)
  return value


def _real(field: str, value: Any, allowed: str) -> float:
  """A finite Python float; bools, strings and arrays are rejected."""
  if not masked.is_number(value):
    _fail(field, value, allowed, 'not a number')
  out = float(value)
  if not math.isfinite(out):
    _fail(field, value, allowed, 'not finite')
  return out


def _parse_float(field: str, text: str, entry: str, allowed: str) -> float:
  """`float(text)`, `text` being part of the string `entry`."""
  try:
    out = float(text)
  except ValueError:
    _fail(field, entry, allowed, f'cannot parse {text!r} as a number')
  if not math.isfinite(out):
    _fail(field, entry, allowed, 'not finite')
  return out


def _entries(value: Any) -> tuple:
  """`None` → (), 'a,b' → ('a', 'b'), sequences → tuple, scalar → (x,)."""
  if value is None:
    return ()
  if isinstance(value, str):
    return tuple(part.strip() for part in value.split(','))
  if isinstance(value, (list, tuple)):
    return tuple(value)
  return (value,)


def _parse_rs(value: Any) -> tuple[str, ...]:
  allowed = ', '.join(RS_CRITERIA)
  names = []
  for entry in _entries(value):
    if not isinstance(entry, str):
      _fail('rs', value, allowed, f'entry {entry!r} is not a string')
    name = entry.strip()
    if not name:
      _fail('rs', value, allowed, 'empty criterion name')
    if name in LEGACY_RS_NAMES:
      _fail(
        'rs',
        value,
        allowed,
        f'legacy name {name!r}: use {LEGACY_RS_NAMES[name]!r}',
      )
    if name not in RS_CRITERIA:
      _fail('rs', value, allowed, f'unknown criterion {name!r}')
    if name in names:
      _fail('rs', value, allowed, f'duplicate criterion {name!r}')
    names.append(name)
  return tuple(names)


def _parse_bound(criterion: str, entry: Any) -> tuple[float | None, float]:
  """One `rs_bounds` entry → canonical `(lo, up)` (`lo=None` for k2/k3)."""
  k1 = criterion.endswith('_k1')
  field = f'rs_bounds[{criterion}]'
  if k1:
    allowed = "'lo_up', (lo, up) or a single up, with 0 < lo <= up"
  else:
    allowed = 'a single number up > 0 (no lower bound for k2/k3)'
  lo: float | None
  if isinstance(entry, str):
    text = entry.strip()
    if '_' in text:
      if not k1:
        _fail(field, entry, allowed, "a 'lo_up' string is only for k1")
      lo_text, up_text = text.split('_', 1)
      lo = _parse_float(field, lo_text, entry, allowed)
      up = _parse_float(field, up_text, entry, allowed)
    else:
      lo, up = None, _parse_float(field, text, entry, allowed)
  elif isinstance(entry, (list, tuple)):
    if len(entry) != 2:
      _fail(field, entry, allowed, 'a pair must have two entries')
    lo = None if entry[0] is None else _real(field, entry[0], allowed)
    up = _real(field, entry[1], allowed)
    if lo is not None and not k1:
      _fail(field, entry, allowed, 'k2/k3 take no lower bound')
  else:
    lo, up = None, _real(field, entry, allowed)
  if not up > 0:
    _fail(field, entry, allowed, 'the upper bound must be > 0')
  if not k1:
    return (None, up)
  if lo is None:
    lo = 1.0 / up
  if not 0 < lo <= up:
    _fail(field, entry, allowed, 'need 0 < lo <= up')
  return (lo, up)


def _parse_rs_bounds(rs: tuple[str, ...], value: Any) -> tuple:
  entries = _entries(value)
  allowed = 'one entry per rs criterion, or one entry for all'
  if not rs:
    if entries:
      _fail('rs_bounds', value, '() when rs is empty', 'rs_bounds without rs')
    return ()
  if not entries:
    _fail('rs_bounds', value, allowed, f'rs={rs!r} needs bounds')
  if len(entries) not in (1, len(rs)):
    _fail(
      'rs_bounds', value, allowed, f'{len(entries)} entries for {len(rs)} rs'
    )
  if len(entries) == 1:
    entries = entries * len(rs)
  return tuple(_parse_bound(c, e) for c, e in zip(rs, entries))


@dataclasses.dataclass(frozen=True)
class CorrectionConfig:
  """Rollout-correction settings (spec §3); frozen, hashable, validated.

  `rs` is stored as a tuple of criterion names and `rs_bounds` as one
  `(lo, up)` pair per criterion (`lo=None` for k2/k3). verl's strings
  (`rs='token_k1,seq_max_k3'`, `rs_bounds='0.5_2.0,0.01'`) and lists are
  accepted. For k1 criteria the band bounds ρ = π_train/π_rollout: keep
  `lo ≤ ratio ≤ up` (D1). Every invalid value raises `ValueError`.
  """

  mode: str = 'decoupled'
  bypass_loss: str = 'ppo_clip'
  is_level: str | None = None
  is_mode: str = 'truncate'
  is_upper: float = 2.0
  is_lower: float | None = None
  is_batch_normalize: bool = False
  rs: tuple[str, ...] = ()
  rs_bounds: tuple[tuple[float | None, float], ...] = ()
  veto_low: float | None = None
  veto_high: float | None = None

  def __post_init__(self):
    def put(name, value):
      object.__setattr__(self, name, value)

    mode = _choice('mode', self.mode, MODES)
    loss = _choice('bypass_loss', self.bypass_loss, BYPASS_LOSSES)
    if mode == 'decoupled' and loss == 'reinforce':
      _fail(
        'bypass_loss',
        loss,
        "'ppo_clip' in decoupled mode ('reinforce' needs mode='bypass')",
      )
    level = _choice('is_level', self.is_level, IS_LEVELS, optional=True)
    _choice('is_mode', self.is_mode, IS_MODES)
    upper = _real('is_upper', self.is_upper, 'a finite float > 0')
    if not upper > 0:
      _fail('is_upper', self.is_upper, 'a finite float > 0')
    put('is_upper', upper)
    if self.is_lower is not None:
      allowed = f'None or a float with 0 < is_lower <= is_upper={upper}'
      lower = _real('is_lower', self.is_lower, allowed)
      if not 0 < lower <= upper:
        _fail('is_lower', self.is_lower, allowed)
      put('is_lower', lower)
    if not isinstance(self.is_batch_normalize, bool):
      _fail('is_batch_normalize', self.is_batch_normalize, 'True or False')
    if self.is_batch_normalize and level is None:
      _fail(
        'is_batch_normalize',
        True,
        "False when is_level=None (set is_level to 'token', 'sequence' or "
        "'geometric')",
        'there are no weights to normalise',
      )
    rs = _parse_rs(self.rs)
    put('rs', rs)
    put('rs_bounds', _parse_rs_bounds(rs, self.rs_bounds))
    if self.veto_low is not None:
      allowed = 'None or a float with 0 < veto_low < 1'
      tau = _real('veto_low', self.veto_low, allowed)
      if not 0 < tau < 1:
        _fail('veto_low', self.veto_low, allowed)
      put('veto_low', tau)
    if self.veto_high is not None:
      allowed = 'None or a float > 1'
      tau = _real('veto_high', self.veto_high, allowed)
      if not tau > 1:
        _fail('veto_high', self.veto_high, allowed)
      put('veto_high', tau)

  @property
  def lower(self) -> float:
    """Cl: `is_lower`, or 1/Cu when unset."""
    return self.is_lower if self.is_lower is not None else 1.0 / self.is_upper
