"""`CorrectionConfig`: the rollout-correction settings
(docs/math/correction.md §3).

A frozen, hashable dataclass (a static jit argument) validated on
construction. It stores a canonical form: `rs` a tuple of criterion names,
`rs_bounds` one `(lo, up)` pair per criterion (`lo=None` except k1). verl's
comma-separated strings and ml-collections lists are accepted. Every invalid
value raises a `ValueError` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxcorr.config.fields import (
  Invalid,
  boolean,
  fail,
  number,
  one_of,
  optional,
  setting,
  validate,
)
from jaxcorr.losses.correction.rejection import (
  RS_CRITERIA,
  STATISTICS,
  criterion,
)

MODES = ('decoupled', 'bypass')
BYPASS_LOSSES = ('ppo_clip', 'reinforce')
IS_LEVELS = ('token', 'sequence', 'geometric')
IS_MODES = ('truncate', 'clip', 'mask')
LEGACY_RS_NAMES = {
  'token': 'token_k1',
  'sequence': 'seq_sum_k1',
  'geometric': 'seq_mean_k1',
}
"""verl's pre-k1 names, rejected with a hint to their replacement."""


# ------------------------------------------------------------------ config


def _real(path: str, value: Any, allowed: str) -> float:
  """A finite Python float; bools, strings and arrays are rejected."""
  try:
    return number()(value, path)
  except Invalid as e:
    fail(path, value, allowed, e.why)


def _parse_float(path: str, text: str, entry: str, allowed: str) -> float:
  """`float(text)`, `text` being part of the string `entry`."""
  try:
    out = float(text)
  except ValueError:
    fail(path, entry, allowed, f'cannot parse {text!r} as a number')
  if not math.isfinite(out):
    fail(path, entry, allowed, 'not finite')
  return out


def _entries(value: Any) -> tuple:
  """`None`/'' → (), 'a,b' → ('a', 'b'), sequences → tuple, scalar → (x,)."""
  if value is None or value == '':
    return ()
  if isinstance(value, str):
    return tuple(part.strip() for part in value.split(','))
  if isinstance(value, (list, tuple)):
    return tuple(value)
  return (value,)


def _parse_rs(value: Any, path: str) -> tuple[str, ...]:
  allowed = ', '.join(RS_CRITERIA)
  names = []
  for entry in _entries(value):
    if not isinstance(entry, str):
      fail(path, value, allowed, f'entry {entry!r} is not a string')
    name = entry.strip()
    if not name:
      fail(path, value, allowed, 'empty criterion name')
    if name in LEGACY_RS_NAMES:
      why = f'legacy name {name!r}: use {LEGACY_RS_NAMES[name]!r}'
      fail(path, value, allowed, why)
    if name not in RS_CRITERIA:
      fail(path, value, allowed, f'unknown criterion {name!r}')
    if name in names:
      fail(path, value, allowed, f'duplicate criterion {name!r}')
    names.append(name)
  return tuple(names)


_BAND_NAMES = '/'.join(name for name, st in STATISTICS.items() if st.band)


def _bound_rule(name: str) -> str:
  """What a bound of statistic `name` may be (`rejection.STATISTICS`)."""
  statistic = STATISTICS[name]
  if statistic.band:
    return "'lo_up', (lo, up) or a single up, with 0 < lo <= up"
  least = statistic.min_upper
  up = f'up >= {least[0]:g}' if least else 'up > 0'
  return f'a single number {up} (no lower bound for {name})'


def _parse_bound(
  path: str, criterion_name: str, entry: Any
) -> tuple[float | None, float]:
  """One `rs_bounds` entry → canonical `(lo, up)` (`lo=None` unless the
  criterion's statistic takes a band)."""
  _, name, statistic = criterion(criterion_name)
  band = statistic.band
  field = f'{path}[{criterion_name}]'
  allowed = _bound_rule(name)
  lo: float | None
  if isinstance(entry, str):
    text = entry.strip()
    if '_' in text:
      if not band:
        why = f"a 'lo_up' string is only for {_BAND_NAMES}"
        fail(field, entry, allowed, why)
      lo_text, up_text = text.split('_', 1)
      lo = _parse_float(field, lo_text, entry, allowed)
      up = _parse_float(field, up_text, entry, allowed)
    else:
      lo, up = None, _parse_float(field, text, entry, allowed)
  elif isinstance(entry, (list, tuple)):
    if len(entry) != 2:
      fail(field, entry, allowed, 'a pair must have two entries')
    lo = None if entry[0] is None else _real(field, entry[0], allowed)
    up = _real(field, entry[1], allowed)
    if lo is not None and not band:
      fail(field, entry, allowed, f'only {_BAND_NAMES} takes a lower bound')
  else:
    lo, up = None, _real(field, entry, allowed)
  if not up > 0:
    fail(field, entry, allowed, 'the upper bound must be > 0')
  least = statistic.min_upper
  if least is not None and up < least[0]:
    fail(field, entry, allowed, least[1])
  if not band:
    return (None, up)
  if lo is None:
    lo = 1.0 / up
  if not 0 < lo <= up:
    fail(field, entry, allowed, 'need 0 < lo <= up')
  return (lo, up)


def _parse_rs_bounds(path: str, rs: tuple[str, ...], value: Any) -> tuple:
  entries = _entries(value)
  allowed = 'one entry per rs criterion, or one entry for all'
  if not rs:
    if entries:
      fail(path, value, '() when rs is empty', 'rs_bounds without rs')
    return ()
  if not entries:
    fail(path, value, allowed, f'rs={rs!r} needs bounds')
  if len(entries) not in (1, len(rs)):
    fail(path, value, allowed, f'{len(entries)} entries for {len(rs)} rs')
  if len(entries) == 1:
    entries = entries * len(rs)
  return tuple(_parse_bound(path, c, e) for c, e in zip(rs, entries))


_POSITIVE = number(0, lo_open=True, allowed='a finite float > 0')


@dataclasses.dataclass(frozen=True)
class CorrectionConfig:
  """Rollout-correction settings (docs/math/correction.md §3); frozen, hashable,
  validated.

  `rs` is stored as a tuple of criterion names and `rs_bounds` as one
  `(lo, up)` pair per criterion (`lo=None` except for k1). verl's strings
  (`rs='token_k1,seq_max_k3'`, `rs_bounds='0.5_2.0,0.01'`) and lists are
  accepted; `''` means none. For k1 criteria the band bounds ρ =
  π_train/π_rollout: keep `lo ≤ ratio ≤ up` (D1). Every invalid value raises
  `ValueError`.
  """

  mode: str = setting(
    'decoupled',
    one_of(*MODES),
    "'decoupled' (π_old forward pass, IS = π_old/μ) or 'bypass' (old := μ).",
  )
  bypass_loss: str = setting(
    'ppo_clip',
    one_of(*BYPASS_LOSSES),
    "Bypass only: 'ppo_clip' (any loss but reinforce) or 'reinforce'.",
  )
  is_level: str | None = setting(
    None,
    one_of(*IS_LEVELS, None),
    "None (no IS weights; CLI: none), 'token', 'sequence' or 'geometric'.",
  )
  is_mode: str = setting(
    'truncate',
    one_of(*IS_MODES),
    "'truncate' min(w, Cu), 'clip' clip(w, Cl, Cu), 'mask' w in [Cl, Cu] "
    'else 0.',
  )
  is_upper: float = setting(2.0, _POSITIVE, 'Cu, the upper IS bound (> 0).')
  is_lower: float | None = setting(
    None, None, 'Cl, the lower IS bound (0 < Cl <= Cu); None means 1/Cu.'
  )
  is_batch_normalize: bool = setting(
    False, boolean, 'Rescale the IS weights to mean 1 (needs is_level).'
  )
  rs: tuple[str, ...] = setting(
    (),
    _parse_rs,
    "Rejection criteria, comma-separated, ANDed; '' for none: "
    + ', '.join(RS_CRITERIA)
    + '.',
    cli='',
  )
  rs_bounds: tuple[tuple[float | None, float], ...] = setting(
    (),
    None,
    "One bound per criterion (or one for all), comma-separated: k1 'lo_up' "
    "or 'up' (lo = 1/up), k2/k3/bkl 'up' > 0, mpe 'up' >= 1; '' for none.",
    cli='',
  )
  veto_low: float | None = setting(
    None,
    optional(
      number(
        0,
        1,
        lo_open=True,
        hi_open=True,
        allowed='None or a float with 0 < veto_low < 1',
      )
    ),
    'τ_lo in (0, 1): a valid token with ρ < τ_lo rejects its whole sequence.',
  )
  veto_high: float | None = setting(
    None,
    optional(number(1, lo_open=True, allowed='None or a float > 1')),
    'τ_hi > 1: a valid token with ρ > τ_hi rejects its whole sequence.',
  )

  def __post_init__(self):
    path = validate(self)
    if self.mode == 'decoupled' and self.bypass_loss == 'reinforce':
      fail(
        f'{path}.bypass_loss',
        'reinforce',
        "'ppo_clip' in decoupled mode ('reinforce' needs mode='bypass')",
      )
    if self.is_lower is not None:
      allowed = f'None or a float with 0 < is_lower <= is_upper={self.is_upper}'
      lower = _real(f'{path}.is_lower', self.is_lower, allowed)
      if not 0 < lower <= self.is_upper:
        fail(f'{path}.is_lower', self.is_lower, allowed)
      object.__setattr__(self, 'is_lower', lower)
    if self.is_batch_normalize and self.is_level is None:
      fail(
        f'{path}.is_batch_normalize',
        True,
        "False when is_level=None (set is_level to 'token', 'sequence' or "
        "'geometric')",
        'there are no weights to normalise',
      )
    bounds = _parse_rs_bounds(f'{path}.rs_bounds', self.rs, self.rs_bounds)
    object.__setattr__(self, 'rs_bounds', bounds)

  @property
  def lower(self) -> float:
    """Cl: `is_lower`, or 1/Cu when unset."""
    return self.is_lower if self.is_lower is not None else 1.0 / self.is_upper
