"""The run's configuration: one declaration per field, one converter.

Modules:
  fields    `setting` (a field's default, rule and doc, declared once on its
            frozen dataclass), the shared rules and error format
  convert   ml-collections sections derived from those dataclasses, and
            the start-up converter `ConfigDict -> RunConfig` with its
            cross-section checks
"""
