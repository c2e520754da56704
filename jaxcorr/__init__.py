"""jaxcorr: JAX/TPU reinforcement-learning trainer for LLMs with rollout correction."""

__version__ = '0.1.0'
