"""`Tool`: a Python function an agent may call, described by the JSON
schema users already write for OpenAI-style function calling::

  Tool(
    name='calculator',
    description='Evaluate an arithmetic expression.',
    parameters={
      'type': 'object',
      'properties': {'expression': {'type': 'string'}},
      'required': ['expression'],
    },
    fn=lambda expression: ...,
  )

`Tool.schema()` is the `{'type': 'function', 'function': {...}}` entry a
chat template's `tools=` argument (and verl / Tunix tool configs) take, so a
tool ports between them by copying its schema. Arguments are checked
against `parameters` with the `jsonschema` package before the function
runs; a call whose arguments do not match is the agent's error, reported
back to it as an observation (`jaxcorr.agents.tool_runner`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jsonschema


class ToolArgumentError(ValueError):
  """The arguments of a call do not match the tool's schema."""


@dataclasses.dataclass(frozen=True)
class Tool:
  """A callable tool.

  Attributes:
    name: what the agent calls it by.
    description: one line for the model (goes into the schema).
    parameters: the JSON schema of the keyword arguments (an object).
    fn: called as `fn(**arguments)`; returns the observation text (any
      other type is a tool failure, `tool_runner`).
  """

  name: str
  description: str
  parameters: Mapping[str, Any]
  fn: Callable[..., Any]

  def __post_init__(self):
    if not self.name or not self.name.replace('_', '').isalnum():
      raise ValueError(
        f'Tool.name: invalid value {self.name!r}; allowed: letters, digits '
        'and underscores'
      )
    if self.parameters.get('type') != 'object':
      raise ValueError(
        f'Tool {self.name!r}: parameters must be a JSON schema of type '
        f"'object', got {self.parameters.get('type')!r}"
      )
    try:
      jsonschema.Draft202012Validator.check_schema(dict(self.parameters))
    except jsonschema.SchemaError as err:
      raise ValueError(
        f'Tool {self.name!r}: invalid parameters schema: {err.message}'
      ) from err

  def schema(self) -> dict[str, Any]:
    """The OpenAI-style function entry."""
    return {
      'type': 'function',
      'function': {
        'name': self.name,
        'description': self.description,
        'parameters': dict(self.parameters),
      },
    }

  def check_arguments(self, arguments: Any) -> dict[str, Any]:
    """`arguments` as a dict; `ToolArgumentError` naming the first
    mismatch with the schema."""
    if not isinstance(arguments, Mapping):
      raise ToolArgumentError(
        f'{self.name}: arguments must be an object, got '
        f'{type(arguments).__name__}'
      )
    errors = sorted(
      jsonschema.Draft202012Validator(dict(self.parameters)).iter_errors(
        dict(arguments)
      ),
      key=lambda e: list(e.path),
    )
    if errors:
      raise ToolArgumentError(f'{self.name}: {errors[0].message}')
    return dict(arguments)

  def text_arguments(self, text: str) -> dict[str, Any]:
    """The arguments of a call whose body is plain text (a 'text' call
    format, `jaxcorr.agents.tool_calls`): `text` as the first required
    parameter, or as the only one; `ToolArgumentError` for a tool with
    neither."""
    required = list(self.parameters.get('required', ()))
    names = required or list(self.parameters.get('properties', {}))
    if not required and len(names) != 1:
      raise ToolArgumentError(
        f'{self.name}: a text call fills one parameter; the schema has '
        f'no required one and {len(names)} in all'
      )
    return {names[0]: text}
