"""Host side of packing: a `TrainBatch`'s sequences laid out in packed rows.

A sequence is the span of a row from its first real prompt token to its
last trained response token (tokens after it cannot change any trained
log-prob: attention is causal); a row with no trained token packs nothing.
Every mini-batch keeps the rows the unpacked update would give it (rows
[m·mb, (m+1)·mb) after the host's shuffle); its rows are then split into
`micro_batches` micro-batches by **token count** (longest first, each to
the micro-batch with the fewest tokens), and each micro-batch's sequences
are packed into R rows of L = P + T tokens (longest first, each to the
emptiest row it fits: rows, and so the contiguous row blocks of the
data-parallel shards, get balanced token counts). R is the same for every
micro-batch of the step (a static shape), rounded up to a multiple of the
batch shards and of a coarse quantum, so steps reuse a few compiled shapes.

Inside a packed row sequence k carries segment id k + 1 (0 on padding) and
the positions it had in its own row, so attention never crosses sequences
and the model sees the same inputs as unpacked. `gather` maps each response
token t of a mini-batch row to the packed position whose output predicts it
(docs/math/rollout_contract.md §5: position P + t − 1 of the row): the
losses keep reading `[rows, T]` arrays, one row per sequence, so every
per-sequence quantity stays per sequence.
"""

from __future__ import annotations

import flax.struct
import numpy as np

from jaxcorr.train.batch import TrainBatch

Array = np.ndarray  # numpy on the host, jax.Array on the devices


@flax.struct.dataclass
class PackedRows:
  """M mini-batches x n micro-batches of R packed rows of L tokens, for the
  mini-batches of `mb` batch rows each."""

  tokens: Array  # [M, n, R, L] int32
  positions: Array  # [M, n, R, L] int32: each token's position in its row
  segment_ids: Array  # [M, n, R, L] int32: k + 1 for sequence k, 0 padding
  temperature: Array  # [M, n, R, L] float32: its row's temperature
  rows: Array  # [M, mb] int32: the batch rows of mini-batch m
  member: Array  # [M, n, mb] bool: row j of mini-batch m is in micro i
  gather: Array  # [M, n, mb, T] int32: flat index into [R * L] outputs

  @property
  def micro_batches(self) -> int:
    return self.tokens.shape[1]

  @property
  def row_tokens(self) -> int:
    """R x L: the token budget of one micro-batch."""
    return self.tokens.shape[2] * self.tokens.shape[3]


def segment_positions(segment_ids: np.ndarray) -> np.ndarray:
  """numpy twin of `jaxcorr.model.segment_positions`: positions restart at 0
  wherever the id changes along the last axis."""
  s = segment_ids.shape[-1]
  idx = np.broadcast_to(np.arange(s), segment_ids.shape)
  change = np.ones(segment_ids.shape, bool)
  change[..., 1:] = segment_ids[..., 1:] != segment_ids[..., :-1]
  start = np.maximum.accumulate(np.where(change, idx, 0), axis=-1)
  return (idx - start).astype(np.int32)


def spans(batch: TrainBatch) -> tuple[np.ndarray, np.ndarray]:
  """(start [B], end [B]): the packed span of each row, [start, end) in the
  row's positions; end == start for a row with no trained token."""
  mask = np.asarray(batch.response_mask, bool)
  seg = np.asarray(batch.segment_ids)
  t = mask.shape[1]
  p = seg.shape[1] - t
  real = seg != 0
  start = np.where(real.any(1), real.argmax(1), 0)
  last = t - 1 - mask[:, ::-1].argmax(1)  # last trained response token
  end = np.where(mask.any(1), p + last + 1, start)
  return start, np.maximum(end, start)


def balanced(lengths: np.ndarray, bins: int) -> list[list[int]]:
  """Indices into `lengths` split into `bins` lists, longest first, each to
  the bin with the fewest tokens (then the fewest items)."""
  load = np.zeros(bins, np.int64)
  count = np.zeros(bins, np.int64)
  out: list[list[int]] = [[] for _ in range(bins)]
  for i in np.argsort(-lengths, kind='stable'):
    k = int(np.lexsort((count, load))[0])
    out[k].append(int(i))
    load[k] += lengths[i]
    count[k] += 1
  return out


def _fit(lengths: np.ndarray, items: list[int], rows: int, cap: int):
  """Place `items` (longest first) into `rows` rows of `cap` tokens, each
  into the emptiest row it fits; None when one does not fit."""
  load = np.zeros(rows, np.int64)
  placed: list[list[int]] = [[] for _ in range(rows)]
  for i in sorted(items, key=lambda i: -lengths[i]):
    if lengths[i] == 0:
      continue
    r = int(np.argmin(load))
    if load[r] + lengths[i] > cap:
      return None
    placed[r].append(i)
    load[r] += lengths[i]
  return placed


def pack(
  batch: TrainBatch,
  *,
  mini_batches: int,
  micro_batches: int,
  shards: int = 1,
  order: np.ndarray | None = None,
) -> PackedRows:
  """Lay out a host `TrainBatch` (numpy, rows a multiple of
  mini_batches x micro_batches x shards) in packed rows (module docstring).

  Args:
    batch: the assembled batch (`batch.assemble`).
    mini_batches, micro_batches: `train.mini_batches`, `train.micro_batches`.
    shards: the batch shards the packed rows are split over.
    order: a permutation of the rows (the host's shuffle), or None.
  """
  b = np.asarray(batch.response_mask).shape[0]
  length = np.asarray(batch.tokens).shape[1]
  mb = b // mini_batches
  order = np.arange(b) if order is None else np.asarray(order)
  start, end = spans(batch)
  lengths = end - start
  per_mini = []
  for m in range(mini_batches):
    rows = order[m * mb : (m + 1) * mb]
    per_mini.append(balanced(lengths[rows], micro_batches))
  # One R for the step: the fewest rows (a multiple of the quantum) that
  # hold the fullest micro-batch.
  quantum = shards * max(1, -(-mb // (micro_batches * shards * 8)))
  need = max(
    int(lengths[order[m * mb + np.asarray(ix, int)]].sum()) if ix else 0
    for m, micros in enumerate(per_mini)
    for ix in micros
  )
  rows_needed = -(-need // length)
  r = max(quantum, -(-rows_needed // quantum) * quantum)
  while True:
    placed = [
      [
        _fit(lengths, [int(order[m * mb + j]) for j in ix], r, length)
        for ix in micros
      ]
      for m, micros in enumerate(per_mini)
    ]
    if all(p is not None for micros in placed for p in micros):
      break
    r += quantum
  return _lay_out(batch, order, per_mini, placed, r, start, end)


def _lay_out(batch, order, per_mini, placed, r, start, end) -> PackedRows:
  tokens_in = np.asarray(batch.tokens)
  seg_in = np.asarray(batch.segment_ids)
  pos_in = segment_positions(seg_in)
  temp_in = np.asarray(batch.temperature, np.float32)
  b, t = np.asarray(batch.response_mask).shape
  length = tokens_in.shape[1]
  p = length - t
  big_m, n = len(per_mini), len(per_mini[0])
  mb = b // big_m
  shape = (big_m, n, r, length)
  tokens = np.zeros(shape, np.int32)
  positions = np.zeros(shape, np.int32)
  segs = np.zeros(shape, np.int32)
  temp = np.ones(shape, np.float32)
  member = np.zeros((big_m, n, mb), bool)
  gather = np.zeros((big_m, n, mb, t), np.int32)
  rows = order.reshape(big_m, mb).astype(np.int32)
  for m in range(big_m):
    where = {int(row): j for j, row in enumerate(rows[m])}
    for i in range(n):
      member[m, i, per_mini[m][i]] = True
      for k, packed in enumerate(placed[m][i]):
        off = 0
        for sid, row in enumerate(packed, 1):
          s, e = start[row], end[row]
          span = slice(off, off + e - s)
          tokens[m, i, k, span] = tokens_in[row, s:e]
          positions[m, i, k, span] = pos_in[row, s:e]
          segs[m, i, k, span] = np.where(seg_in[row, s:e] != 0, sid, 0)
          temp[m, i, k, span] = temp_in[row]
          # Response token tt is predicted at row position p + tt - 1.
          q = p + np.arange(t) - 1
          ok = (q >= s) & (q < e)
          flat = k * length + off + q - s
          gather[m, i, where[row]] = np.where(ok, flat, 0)
          off += e - s
  return PackedRows(
    tokens=tokens,
    positions=positions,
    segment_ids=segs,
    temperature=temp,
    rows=rows,
    member=member,
    gather=gather,
  )


def packed_tokens(packed: PackedRows) -> int:
  """The real tokens the packed rows hold (for the fill metric)."""
  return int((np.asarray(packed.segment_ids) != 0).sum())
