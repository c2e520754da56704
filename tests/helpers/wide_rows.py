"""`widen`: a step batch with longer (empty) response columns, so that its
sequences are short next to the row length and several share a packed row."""

from __future__ import annotations

import numpy as np

from jaxcorr.train.batch import TrainBatch


def widen(batch: TrainBatch, extra: int) -> TrainBatch:
  """`batch` with `extra` more response positions, every one off the mask
  (padding tokens, segment 0, zeros)."""
  out = {}
  for name in ('tokens', 'segment_ids', 'response_mask', 'rollout_logp',
               'version_gap'):  # fmt: skip
    x = getattr(batch, name)
    if x is not None:
      out[name] = np.pad(x, ((0, 0), (0, extra)))
  return batch.replace(**out)
