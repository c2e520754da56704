"""Checkpoints and the workdir: saving, restoring, resuming, never losing a run.

Modules: `checkpointer` (the `Checkpointer`), `restore` (reading a step back,
falling back to the newest intact one), `tree` (the on-disk form),
`failed_restore` (what a failed Orbax restore leaves behind), `resume` (what a
checkpoint holds and resuming from it), `workdir` (one trainer per workdir,
the same run on resume).
"""
