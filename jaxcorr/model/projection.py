"""A dense projection whose weight gradient is one plain 2-D matmul.

`dense_einsum('bsd,df->bsf', x, w)` computes exactly `jnp.einsum` forward.
Its backward gives the input gradient by the transposed einsum, and the
weight gradient as one `[in, N] @ [N, out]` product over the N flattened
tokens, transposing whichever of the two operands is narrower (the input
when `in <= out`, else the output cotangent, then the small `[out, in]`
result).

Why not let autodiff write it: the weight gradient of an einsum is a
`dot_general` that contracts the token dimensions of both operands. XLA:CPU
lays that dot out with the *cotangent* transposed, and fuses the transpose
into the elementwise producer of that cotangent (SwiGLU's gate derivative).
The fused loop then writes a `[F, N]` array column by column. On the bench
model that one fusion cost 130 ms per layer, a fifth of the layers'
forward + backward (bench/update_split.py, docs/benchmarks.md "The layers'
weight gradients and attention's backward"). Written as a plain product of
a transposed narrow operand, the same layers run 1.4x faster. The values
are the same products summed in another order (1e-6 relative in float32,
tested). GPU and TPU matmuls take a transposed operand natively, so the
form should cost them nothing; that is not measured yet.

The output carries the checkpoint name `PROJECTION`, so the `dots` remat
policy (jaxcorr/model/transformer.py) still saves these products: a
`custom_vjp` call is not a `dot_general` to `jax.checkpoint`'s policies.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

PROJECTION = 'projection'
"""The checkpoint name of every `dense_einsum` output."""


def _operands(equation: str) -> tuple[str, str, str]:
  inputs, out = equation.split('->')
  lhs, rhs = inputs.split(',')
  return lhs, rhs, out


def check_equation(equation: str) -> None:
  """Raises ValueError unless `equation` is 'x,w->y' where the kernel `w`
  shares only contracted letters with `x` (no batch letters in the kernel)
  and every letter appears once per operand."""
  lhs, rhs, out = _operands(equation)
  shared = set(lhs) & set(rhs) & set(out)
  if shared or len(set(lhs)) != len(lhs) or len(set(rhs)) != len(rhs):
    raise ValueError(
      f'dense_einsum equation {equation!r}: the kernel must not carry '
      'batch letters and no letter may repeat in an operand'
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def _dense(equation, x, w, precision, out_dtype):
  return jnp.einsum(
    equation, x, w, precision=precision, preferred_element_type=out_dtype
  )


def _dense_fwd(equation, x, w, precision, out_dtype):
  return _dense(equation, x, w, precision, out_dtype), (x, w)


def _dense_bwd(equation, precision, out_dtype, residuals, dy):
  x, w = residuals
  lhs, rhs, out = _operands(equation)
  # A wider cotangent (`out_dtype`) promotes the narrow operand: both
  # products accumulate at the cotangent's precision, as autodiff's do.
  dx = jnp.einsum(f'{out},{rhs}->{lhs}', dy, w, precision=precision)
  tokens = [c for c in lhs if c not in rhs]
  contracted = [c for c in lhs if c in rhs]
  features = [c for c in rhs if c not in lhs]
  # Token-major 2-D views: [N, in] and [N, out].
  x2 = jnp.einsum(f'{lhs}->{"".join(tokens + contracted)}', x)
  dy2 = jnp.einsum(f'{out}->{"".join(tokens + features)}', dy)
  n = math.prod(x2.shape[: len(tokens)])
  x2 = x2.reshape(n, -1)
  dy2 = dy2.reshape(n, -1)
  if x2.shape[1] <= dy2.shape[1]:
    dw2 = jnp.dot(x2.T, dy2, precision=precision)
  else:
    dw2 = jnp.dot(dy2.T, x2, precision=precision).T
  sizes = dict(zip(lhs, x.shape)) | dict(zip(rhs, w.shape))
  dw = dw2.reshape([sizes[c] for c in contracted + features])
  dw = jnp.einsum(f'{"".join(contracted + features)}->{rhs}', dw)
  return dx.astype(x.dtype), dw.astype(w.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)


def dense_einsum(
  equation: str,
  x: jax.Array,
  w: jax.Array,
  precision: jax.lax.Precision | None = None,
  preferred_element_type: jnp.dtype | None = None,
) -> jax.Array:
  """`jnp.einsum(equation, x, w, precision=..., preferred_element_type=...)`
  with the weight gradient of the module docstring. x and w share a dtype;
  `equation` as in `check_equation`."""
  check_equation(equation)
  y = _dense(equation, x, w, precision, preferred_element_type)
  return checkpoint_name(y, PROJECTION)
