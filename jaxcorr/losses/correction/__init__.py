"""The rollout correction: IS weights, rejection, veto and diagnostics
(docs/math/correction.md).

The package face: callers use the names of `__all__` from here,

    from jaxcorr.losses import correction
    cfg = correction.CorrectionConfig(is_level='token', rs='seq_mean_k1',
                                      rs_bounds='0.999_1.001')
    out = correction.rollout_correction(old_logp, rollout_logp, mask, cfg)

and any other name from the module that defines it:

  config     `CorrectionConfig` (validated, hashable settings) and its parsing
  apply      `rollout_correction`, the entry that applies the three below
  weights    raw, bounded and batch-normalised IS weights
  rejection  the rejection-statistic registry (k1/k2/k3, KPop's bkl, NeMo's
             mpe) with its levels, the RS criteria, the veto
  seq_error  NeMo-RL's sequence log-prob error mask on its own, in its shape
  metrics    the `rollout_corr/` diagnostics
"""

from jaxcorr.losses.correction.apply import (
  METRIC_PREFIX,
  Correction,
  gap_metric_weights,
  rollout_correction,
)
from jaxcorr.losses.correction.config import CorrectionConfig

__all__ = [
  'METRIC_PREFIX',
  'Correction',
  'CorrectionConfig',
  'gap_metric_weights',
  'rollout_correction',
]
