"""Loss aggregation: per-token values `[B, T]` to one scalar
(docs/math/losses.md §2).

With L the sanitised per-token values, m the mask, `n_i = Σ_t m` and
`v_i = [n_i > 0]`:

=========================  ==================================================
mode (verl alias)          value
=========================  ==================================================
token_mean                 `Σ L·m / N_tok`
token_sum                  `Σ L·m`
seq_mean_token_sum         `Σ_i v_i·Σ_t L·m / N_seq`
seq_mean_token_mean        `Σ_i v_i·(Σ_t L·m / n_i) / N_seq`
seq_mean_token_sum_norm    `seq_mean_token_sum / (norm or T)`
=========================  ==================================================

`N_tok` (`N_seq`) is `num_tokens` (`num_seqs`) when given — a global count
over the whole mini-batch, every device and micro-batch — else the local
`Σ m` (`Σ v`). Empty selections give exactly 0 (D2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcorr.config import fields
from jaxcorr.losses import masked

MODES = (
  'token_mean',
  'token_sum',
  'seq_mean_token_sum',
  'seq_mean_token_mean',
  'seq_mean_token_sum_norm',
)
ALIASES = {m.replace('_', '-'): m for m in MODES}
"""verl's hyphenated spellings (`loss_agg_mode`)."""


def canonical_mode(mode: str, field: str = 'agg') -> str:
  """The canonical (underscore) name of an aggregation mode, or ValueError."""
  if mode in MODES:
    return mode
  if mode in ALIASES:
    return ALIASES[mode]
  allowed = ', '.join(f'{m} ({m.replace("_", "-")})' for m in MODES)
  raise ValueError(
    f'{field}={mode!r} is not an aggregation mode; allowed: {allowed}'
  )


def _check_norm(norm: float | None) -> None:
  if fields.is_number(norm) and not norm > 0:
    raise ValueError(f'norm must be > 0, got {norm!r}')


def aggregate_terms(
  per_token: jax.Array,
  mask: jax.Array,
  mode: str,
  *,
  norm: float | jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Numerator and count of an aggregation, for accumulation.

  Use this when the normaliser is only known after the forward pass (bypass
  mode with rejection): accumulate both over micro-batches, then call
  `finalize(numerator, count, mode)` once. The count carries no gradient, so
  the result equals `aggregate` on the whole mini-batch exactly.

  Args:
    per_token: `[B, T]` float per-token values.
    mask: `[B, T]` bool.
    mode: an aggregation mode or its verl alias.
    norm: divisor of `seq_mean_token_sum_norm` (None: the padded length T).

  Returns:
    `(numerator, count)` scalars. `count` is `Σ m` for `token_mean` and
    `token_sum` (ignored by `finalize` for the latter) and the number of
    non-empty rows for the `seq_mean_*` modes.
  """
  mode = canonical_mode(mode)
  masked.check_mask(mask)
  masked.check_shapes({'per_token': per_token, 'mask': mask})
  _check_norm(norm)
  values = masked.sanitize(per_token, mask)
  dtype = values.dtype
  if mode in ('token_mean', 'token_sum'):
    num = jnp.sum(values)
    cnt = masked.count(mask, dtype)
  else:
    rows = jnp.sum(values, axis=-1)
    n_i = masked.row_count(mask, dtype)
    if mode == 'seq_mean_token_mean':
      rows = masked.safe_div(rows, n_i)
    num = jnp.sum(rows)  # empty rows add exactly 0
    if mode == 'seq_mean_token_sum_norm':
      num = num / (per_token.shape[-1] if norm is None else norm)
    cnt = jnp.sum(n_i > 0, dtype=dtype)
  return num, jax.lax.stop_gradient(cnt)


def finalize(numerator: jax.Array, count: jax.Array, mode: str) -> jax.Array:
  """Turns accumulated `aggregate_terms` into the loss value."""
  if canonical_mode(mode) == 'token_sum':
    return numerator
  return masked.safe_div(numerator, jax.lax.stop_gradient(count))


def aggregate(
  per_token: jax.Array,
  mask: jax.Array,
  mode: str,
  *,
  num_tokens: float | jax.Array | None = None,
  num_seqs: float | jax.Array | None = None,
  norm: float | jax.Array | None = None,
) -> jax.Array:
  """Aggregates per-token values to a scalar loss.

  Args:
    per_token: `[B, T]` float per-token values (masked entries may hold
      anything, NaN included).
    mask: `[B, T]` bool; True on tokens that enter the loss.
    mode: one of `MODES` or its verl alias (`token-mean`, ...).
    num_tokens: global token count replacing the local `Σ m` (token_mean).
    num_seqs: global non-empty row count replacing the local one (seq_*).
    norm: divisor of `seq_mean_token_sum_norm`; None means T (verl).

  Returns:
    A scalar in the computation dtype (at least float32).
  """
  mode = canonical_mode(mode)
  num, cnt = aggregate_terms(per_token, mask, mode, norm=norm)
  if mode == 'token_mean' and num_tokens is not None:
    cnt = jnp.asarray(num_tokens, num.dtype)
  elif mode.startswith('seq_') and num_seqs is not None:
    cnt = jnp.asarray(num_seqs, num.dtype)
  return finalize(num, cnt, mode)
