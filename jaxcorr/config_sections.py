"""Reading one ml-collections section into a frozen, validated dataclass.

Shared by the start-up converters (`loss_config`, `algorithm_config`): they
turn `config.<section>` into the hashable dataclasses that cross the jit
boundary, and every error names the config path (`config.correction.rs`),
the value and the allowed values.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections


def values(section: Any) -> dict[str, Any]:
  """A section's fields as a plain dict (ConfigDict or mapping)."""
  if isinstance(section, ml_collections.ConfigDict):
    return section.to_dict()
  return dict(section)


def fields(cls: type) -> tuple[str, ...]:
  """The field names of a dataclass."""
  return tuple(f.name for f in dataclasses.fields(cls))


def check_keys(path: str, got: dict, allowed: tuple[str, ...]) -> None:
  """ValueError for keys of `got` outside `allowed` (a typo got past)."""
  unknown = sorted(set(got) - set(allowed))
  if unknown:
    raise ValueError(
      f'{path} has unknown field(s) {", ".join(unknown)}; allowed: '
      + ', '.join(allowed)
    )


def construct(cls: type, path: str, kwargs: dict[str, Any]) -> Any:
  """`cls(**kwargs)`, with its ValueError re-raised under the config path.

  A message that starts with `ClassName.` is rewritten to `path.`; any
  other message is prefixed with `path: `.
  """
  try:
    return cls(**kwargs)
  except ValueError as e:
    msg = str(e)
    prefix = f'{cls.__name__}.'
    if msg.startswith(prefix):
      msg = f'{path}.{msg[len(prefix) :]}'
    else:
      msg = f'{path}: {msg}'
    raise ValueError(msg) from e
