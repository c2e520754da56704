"""Mixed precision: bf16 compute over float32 master weights on accelerators.

The policy's parameters (`model.param_dtype`, float32 by default) are the
master weights: the optimizer reads and writes them, and AdamW's moments
are shaped and typed like them (optax), so both stay float32. Each use casts
them to the compute dtype (`model.dtype`) inside the jitted program, and the
cast's transpose returns float32 gradients to them. What stays float32
whatever the compute dtype (jaxcorr/model/layers.py, logprobs.py): RMSNorm
statistics, RoPE, attention scores and softmax, the head's products (float32
accumulation) and every logit, logsumexp and log-prob; the micro-batches'
gradients are summed in float32 (`grad_accumulator`, `accumulate`).

`model.dtype='auto'` (the default) is resolved once, when the policy's
`TransformerConfig` is built (`compute_dtype`): float32 on CPU, where bf16
has no fast matmul and only costs converts, bfloat16 on GPU and TPU, as
peers train. The backend is asked then, not when the config is built: at
config time JAX's backend must not start yet (`jax.distributed.initialize`
has to come first).

No loss scaling: bfloat16 has float32's 8 exponent bits, so a gradient
small enough to underflow bf16 underflows float32 too (fp16, with 5, needs
a scaled loss; `model.dtype='float16'` is refused for that reason).
docs/precision.md, "Mixed-precision training", has the numbers.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxcorr.config.fields import Invalid, Rule

AUTO = 'auto'
COMPUTE_DTYPES = (AUTO, 'float32', 'bfloat16')
"""`model.dtype`'s values."""
PARAM_DTYPES = ('float32', 'bfloat16')
"""`model.param_dtype`'s values (float32: master weights; bfloat16 halves
the state but rounds every update to 8 bits)."""
BY_BACKEND = {
  'cpu': 'float32',
  'gpu': 'bfloat16',
  'cuda': 'bfloat16',
  'rocm': 'bfloat16',
  'tpu': 'bfloat16',
}
"""What `model.dtype='auto'` computes in, by `jax.default_backend()`."""

_FP16_WHY = (
  'float16 compute needs loss scaling, which the trainer does not do; '
  "bfloat16 has float32's exponent range and needs none"
)


def dtype_rule(*allowed: str) -> Rule:
  """One of `allowed`; float16 is refused with the loss-scaling reason."""
  text = ', '.join(repr(a) for a in allowed)

  def rule(value: Any, path: str) -> Any:
    if value not in allowed:
      raise Invalid(text, _FP16_WHY if value == 'float16' else '')
    return value

  return rule


def compute_dtype(dtype: str, backend: str | None = None) -> str:
  """`model.dtype` resolved: itself, or for 'auto' `BY_BACKEND[backend]`
  (`backend` None: `jax.default_backend()`, which starts the backend)."""
  if dtype != AUTO:
    return dtype
  backend = backend or jax.default_backend()
  if backend not in BY_BACKEND:
    raise ValueError(
      f"config.model.dtype='auto' has no default on backend {backend!r} "
      f'(known: {", ".join(sorted(BY_BACKEND))}); allowed: set '
      "config.model.dtype to 'float32' or 'bfloat16'"
    )
  return BY_BACKEND[backend]


def _floating(x: Any) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating)


def grad_accumulator(params: Any) -> Any:
  """Zeros like `params`, float32 for every floating leaf: the sum of the
  micro-batches' gradients (bf16 params would otherwise sum in bf16)."""
  # zeros_like (not zeros): the sums keep the params' shardings.
  return jax.tree.map(
    lambda p: jnp.zeros_like(p, jnp.float32 if _floating(p) else None),
    params,
  )


def accumulate(acc: Any, grads: Any) -> Any:
  """`acc + grads`, in the accumulator's dtype."""
  return jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads)


def like_params(grads: Any, params: Any) -> Any:
  """The summed gradients in their params' dtypes (a no-op for float32
  params; `jaxcorr.train.state.apply_updates` calls it): optax keeps its
  state in the params' dtypes only when the gradients arrive in them."""
  return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
