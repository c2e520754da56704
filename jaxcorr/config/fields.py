"""A config field declared once: its name, type, default, rule and doc.

Every frozen config dataclass (each beside the component it configures:
`RolloutConfig`, `DataConfig`, `RewardConfig`, `CorrectionConfig`,
`ActorLossConfig` and its `PolicyKnobs`, `AdvantageConfig`, `MeshConfig`,
...; `jaxcorr/train/build.py` lists the trainer's) declares each field with
`setting`::

  mode: str = setting('sync', one_of('sync', 'async'), 'How rollouts run.')

and validates itself with `validate(self)` in `__post_init__`: field rules
and rules between fields of the same section only, never a registry, a
tokenizer or another section (those are build-time checks of
`jaxcorr.train.build`). Everything else is derived from that one line: the
ml-collections section of `configs/` (`jaxcorr.config.convert.section`: the
default, a typed placeholder when it is None, the doc), the check and the
canonical stored value, and the error message.

Errors name the full config path when they are raised: the converter builds
each section inside `at('config.rollout')`, so a bad value reads
`config.rollout.mode: invalid value 'asynch'; allowed: 'sync', 'async'`; a
dataclass built directly names its class (`RolloutConfig.mode: ...`).
Sections of the loss library whose fields are knobs and coefficients
(`ActorLossConfig`, `PolicyKnobs`) use the library's `name=value` form
(`config.actor.clip_ratio_c=1.0 is invalid; allowed: ...`), the form the
aggregation-mode and KL-estimator checks have always used.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import numbers
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

_PATH: contextvars.ContextVar[str | None] = contextvars.ContextVar(
  'config_path', default=None
)


@contextlib.contextmanager
def at(path: str) -> Iterator[None]:
  """Sections built inside name their fields `path.<field>` in errors."""
  token = _PATH.set(path)
  try:
    yield
  finally:
    _PATH.reset(token)


def path_of(obj: Any) -> str:
  """The config path of a section being validated (its class name outside
  `at`)."""
  return _PATH.get() or type(obj).__name__


class Invalid(Exception):
  """Raised by a rule; `validate` turns it into the field's ValueError."""

  def __init__(self, allowed: str, why: str = ''):
    super().__init__(allowed)
    self.allowed, self.why = allowed, why


def fail(path: str, value: Any, allowed: str, why: str = '') -> NoReturn:
  """`ValueError('<path>: invalid value <value> (<why>); allowed: ...')`."""
  why = f' ({why})' if why else ''
  raise ValueError(f'{path}: invalid value {value!r}{why}; allowed: {allowed}')


def fail_assign(path: str, value: Any, allowed: str, why: str = '') -> NoReturn:
  """`ValueError('<path>=<value> is invalid (<why>); allowed: ...')`."""
  why = f' ({why})' if why else ''
  raise ValueError(f'{path}={value!r} is invalid{why}; allowed: {allowed}')


Rule = Callable[[Any, str], Any]
"""`rule(value, path) -> stored value`; raises `Invalid` (or a ValueError that
already names `path`)."""


def is_number(value: object) -> bool:
  """A static Python real number (not a bool, string, array or tracer).

  Config and knob checks use it: a traced value is only checked where the
  math allows it, a bool is never accepted where a number is expected.
  """
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check(rule: Rule, value: Any, path: str) -> Any:
  """`rule(value, path)` for a value outside any dataclass (a constructor
  argument, a task field read before its section is built): `Invalid`
  becomes `fail`'s ValueError naming `path`."""
  try:
    return rule(value, path)
  except Invalid as e:
    fail(path, value, e.allowed, e.why)


def setting(
  default: Any, rule: Rule | None, doc: str, *, cli: Any = dataclasses.MISSING
) -> Any:
  """A dataclass field with its rule and doc; `cli` is the ml-collections
  default when it differs from the stored one (`rs`: `''` for `()`)."""
  meta = {'rule': rule, 'doc': doc}
  if cli is not dataclasses.MISSING:
    meta['cli'] = cli
  return dataclasses.field(default=default, metadata=meta)


def validate(obj: Any, *, assign_form: bool = False) -> str:
  """Runs every field's rule on `obj` and stores the canonical values.

  Returns the section's config path, for the class's own cross-field checks.
  """
  path = path_of(obj)
  raise_ = fail_assign if assign_form else fail
  for f in dataclasses.fields(obj):
    rule = f.metadata.get('rule')
    if rule is None:
      continue
    value = getattr(obj, f.name)
    try:
      out = rule(value, f'{path}.{f.name}')
    except Invalid as e:
      raise_(f'{path}.{f.name}', value, e.allowed, e.why)
    if out is not value:
      object.__setattr__(obj, f.name, out)
  return path


def docs(cls: type) -> dict[str, str]:
  """Field name -> doc of a config dataclass."""
  return {f.name: f.metadata.get('doc', '') for f in dataclasses.fields(cls)}


# ------------------------------------------------------------------- rules


def integer(lo: int, hi: int | None = None) -> Rule:
  """An int (not a bool) >= lo (and <= hi)."""
  allowed = f'an int >= {lo}' if hi is None else f'an int in [{lo}, {hi}]'

  def rule(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
      raise Invalid(allowed)
    if hi is not None and value > hi:
      raise Invalid(allowed)
    return value

  return rule


def _describe(lo, hi, lo_open, hi_open, finite) -> str:
  kind = 'a finite number' if finite else 'a number'
  if lo is not None and hi is not None:
    left, right = '(' if lo_open else '[', ')' if hi_open else ']'
    return f'a number in {left}{lo}, {hi}{right}'
  if lo is not None:
    return f'{kind} {">" if lo_open else ">="} {lo}'
  if hi is not None:
    return f'{kind} {"<" if hi_open else "<="} {hi}'
  return kind


def number(
  lo: float | None = None,
  hi: float | None = None,
  *,
  lo_open: bool = False,
  hi_open: bool = False,
  finite: bool = True,
  allowed: str | None = None,
) -> Rule:
  """A real number (not a bool or string) in the bounds, stored as float.

  NaN never passes; infinity only with `finite=False`.
  """
  text = allowed or _describe(lo, hi, lo_open, hi_open, finite)

  def rule(value: Any, path: str) -> float:
    if not is_number(value):
      raise Invalid(text, 'not a number')
    out = float(value)
    if math.isnan(out) or (finite and not math.isfinite(out)):
      raise Invalid(text, 'not finite' if finite else '')
    low_ok = lo is None or (out > lo if lo_open else out >= lo)
    high_ok = hi is None or (out < hi if hi_open else out <= hi)
    if not (low_ok and high_ok):
      raise Invalid(text)
    return out

  return rule


def optional(rule: Rule, none_means: str | None = None) -> Rule:
  """None, or a value `rule` accepts; `none_means` documents None in the
  allowed text (leave it out when the rule's own text says it)."""

  def wrapped(value: Any, path: str) -> Any:
    if value is None or none_means is None:
      return None if value is None else rule(value, path)
    try:
      return rule(value, path)
    except Invalid as e:
      raise Invalid(f'{e.allowed}, or None ({none_means})', e.why) from None

  return wrapped


DTYPES = ('float32', 'bfloat16', 'float16')
"""The floating dtypes a config may name (parameters, compute, the engine)."""


def one_of(*choices: Any, quote: bool = True) -> Rule:
  """One of `choices` (compared with ==)."""
  text = ', '.join(repr(c) if quote else str(c) for c in choices)

  def rule(value: Any, path: str) -> Any:
    if value not in choices:
      raise Invalid(text)
    return value

  return rule


def boolean(value: Any, path: str) -> bool:
  """True or False (not 0/1)."""
  if not isinstance(value, bool):
    raise Invalid('True or False', 'not a bool: True, False')
  return value


def text(value: Any, path: str) -> str:
  """Any string."""
  if not isinstance(value, str):
    raise Invalid('a string')
  return value


def canonical(fn: Callable[[Any, str], Any]) -> Rule:
  """A rule from a library canonicaliser `fn(value, field_name)` that raises
  its own ValueError naming the field (aggregation modes, KL estimators)."""

  def rule(value: Any, path: str) -> Any:
    return fn(value, path)

  return rule
