"""Sequence packing for the update (`train.packing`).

Modules: `layout` (host, numpy: which rows go to which micro-batch and where
their tokens sit in the packed rows, `PackedRows`), `forward` (device: the
policy's forward pass over packed rows, its log-probs gathered back to the
`[B, T]` response layout every loss reads).
"""
