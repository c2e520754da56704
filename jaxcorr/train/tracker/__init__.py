"""Metrics out of the loop: how each one reduces, and where it is written.

Modules: `reduction` (how a metric combines across micro-batches and
processes), `metrics` (metrics.jsonl, the progress line, the sinks),
`tensorboard` (event files without TensorFlow).
"""
