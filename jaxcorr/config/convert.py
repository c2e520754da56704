"""ml-collections sections <-> the frozen config dataclasses (start-up).

Each field is declared once, as a `setting` of its dataclass
(`jaxcorr.config.fields`). From those declarations, for any such class:

* `section(cls)` derives the ConfigDict section `configs/` assigns (the
  defaults, typed placeholders for None, an `enabled` switch for sections
  that can be off);
* `build(cls, path, values)` turns a section back into `cls`, checking
  every field by its own rule, with errors named under `path`.

Which sections a run has, and the rules that span several of them, are the
composition root's (`jaxcorr.train.build`); nothing here knows a section.

Every error is a `ValueError` raised with the full config path
(`config.rollout.mode: invalid value 'asynch'; allowed: 'sync', 'async'`):
each section is constructed inside `fields.at('config.<section>')`.

Command line: absl parses a float override as a float, so None cannot be
typed for a float field. Optional strings (`correction.is_level`,
`actor.agg`) accept the string `none`, and the dual clip is switched off
with `--config.actor.clip_ratio_c=inf` (the same loss as None).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import ml_collections
from ml_collections import config_dict

from jaxcorr.config import fields

SWITCH = 'enabled'
"""The ConfigDict-only field of a section that can be off (the dataclass is
then None), e.g. `correction.enabled` (False: no correction, no rollout
log-prob needed)."""

# ------------------------------------------------------------- derivation


def _scalar_type(hint: Any) -> type:
  """`float | None` -> float (the type of a placeholder)."""
  if (
    isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
  ):
    (hint,) = (a for a in typing.get_args(hint) if a is not type(None))
  return hint


def _settings(cls: type) -> list[dataclasses.Field]:
  return [f for f in dataclasses.fields(cls) if 'doc' in f.metadata]


def names(cls: type) -> tuple[str, ...]:
  """The names of `cls`'s settings (its fields that have a section key)."""
  return tuple(f.name for f in _settings(cls))


def section(
  cls: type, *, switch: bool | None = None
) -> ml_collections.ConfigDict:
  """The ConfigDict of `cls`'s settings at their defaults.

  A None default becomes a typed placeholder, so a CLI override is parsed
  with the right type; `switch` adds `enabled` with that default.
  """
  hints = typing.get_type_hints(cls)
  out = ml_collections.ConfigDict()
  if switch is not None:
    out[SWITCH] = switch
  for f in _settings(cls):
    default = f.metadata.get('cli', f.default)
    if default is None:
      default = config_dict.placeholder(_scalar_type(hints[f.name]))
    out[f.name] = default
  return out


# -------------------------------------------------------------- conversion


def values(section_: Any) -> dict[str, Any]:
  """A section's fields as a plain dict (a ConfigDict or a mapping)."""
  if isinstance(section_, ml_collections.ConfigDict):
    return section_.to_dict()
  return dict(section_)


def part(config: Any, name: str) -> dict[str, Any]:
  """The fields of `config.<name>`, or of `config` when it is the section."""
  is_cd = isinstance(config, ml_collections.ConfigDict)
  if is_cd and isinstance(config.get(name), ml_collections.ConfigDict):
    config = config[name]
  return values(config)


def check_keys(path: str, got: dict, allowed: tuple[str, ...]) -> None:
  """A key outside `allowed` is a typo that got past the locked config."""
  unknown = sorted(set(got) - set(allowed))
  if unknown:
    raise ValueError(
      f'{path} has unknown field(s) {", ".join(unknown)}; allowed: '
      + ', '.join(allowed)
    )


def build(
  cls: type, path: str, values: dict[str, Any], *, switch: bool | None = None
) -> Any:
  """`cls(**values)` with errors named under `path`; None when the section
  has a switch and it is off."""
  allowed = names(cls)
  check_keys(
    path, values, (SWITCH, *allowed) if switch is not None else allowed
  )
  if switch is not None:
    on = values.pop(SWITCH, switch)
    if not isinstance(on, bool):
      fields.fail(f'{path}.{SWITCH}', on, 'True or False', 'not True, False')
    if not on:
      return None
  hints = typing.get_type_hints(cls)
  for name, value in values.items():  # the CLI spelling of None
    optional_str = _scalar_type(hints[name]) is str and hints[name] is not str
    if optional_str and isinstance(value, str) and value.lower() == 'none':
      values[name] = None
  with fields.at(path):
    return cls(**values)
