"""On-policy distillation: the teacher (config, start-up checks, loading)
and its log-probs in `prepare` (docs/distillation.md). The losses are pure
functions in jaxcorr/losses/distill.py."""

from jaxcorr.train.distill.config import DistillConfig

__all__ = ['DistillConfig']
