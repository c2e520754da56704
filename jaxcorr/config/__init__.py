"""The config mechanism, generic: it knows no section and imports nothing
of jaxcorr above it.

Modules:
  fields    `setting` (a field's default, rule and doc, declared once on its
            frozen dataclass), the shared rules and error format
  convert   a dataclass's ml-collections section (`section`) and back
            (`build`), errors named by config path

Each section's dataclass lives beside the component it configures; the
trainer's composition root, jaxcorr/train/build.py, assembles them into the
`RunConfig` and checks the combinations.
"""
