"""The host layout of packed rows: every trained token once, where its
log-prob is read, micro-batches balanced by tokens, static shapes."""

from __future__ import annotations

import numpy as np
import pytest

from jaxcorr.model import segment_positions
from jaxcorr.train import build
from jaxcorr.train.packing import layout
from tests.helpers.step_batches import P, step_arrays
from tests.helpers.trainer_config import pulse_config
from tests.helpers.wide_rows import widen


@pytest.fixture(scope='module')
def arrays():
  return step_arrays(build.build(pulse_config()), 8)


@pytest.mark.parametrize('mini,micro,shards', [(1, 1, 1), (2, 2, 1), (1, 2, 2)])
def test_every_trained_token_is_read_where_it_is_predicted(
  arrays, mini, micro, shards
):
  pk = layout.pack(
    arrays, mini_batches=mini, micro_batches=micro, shards=shards
  )
  big_m, n, r, length = pk.tokens.shape
  assert (big_m, n) == (mini, micro) and r % shards == 0
  assert length == arrays.tokens.shape[1]
  mask = arrays.response_mask
  t = mask.shape[1]
  # Each row of each mini-batch is in exactly one micro-batch.
  assert (pk.member.sum(1) == 1).all()
  assert sorted(pk.rows.reshape(-1)) == list(range(arrays.rows))
  flat_tok = pk.tokens.reshape(big_m, n, -1)
  flat_seg = pk.segment_ids.reshape(big_m, n, -1)
  flat_pos = pk.positions.reshape(big_m, n, -1)
  want_pos = layout.segment_positions(arrays.segment_ids)
  for m in range(big_m):
    for j, row in enumerate(pk.rows[m]):
      (i,) = np.nonzero(pk.member[m, :, j])[0]
      for tt in np.nonzero(mask[row])[0]:
        g = pk.gather[m, i, j, tt]
        # The output at g predicts the next packed token: this response token,
        # in the same sequence, at the position it has in its own row.
        assert flat_tok[m, i, g + 1] == arrays.tokens[row, P + tt]
        assert flat_seg[m, i, g] == flat_seg[m, i, g + 1] != 0
        assert flat_pos[m, i, g + 1] == want_pos[row, P + tt]
  # Only the real tokens of trained spans are packed.
  start, end = layout.spans(arrays)
  assert layout.packed_tokens(pk) <= (end - start).sum()
  assert layout.packed_tokens(pk) >= mask.sum()
  del t


def test_positions_match_the_model():
  seg = np.array([[0, 0, 1, 1, 1, 0, 2, 2]])
  np.testing.assert_array_equal(
    layout.segment_positions(seg), np.asarray(segment_positions(seg))
  )


def test_micro_batches_balance_tokens():
  rng = np.random.default_rng(0)
  lengths = rng.integers(10, 200, 64)
  bins = layout.balanced(lengths, 4)
  loads = [lengths[b].sum() for b in bins]
  assert sorted(i for b in bins for i in b) == list(range(64))
  assert max(loads) - min(loads) <= lengths.max()


def test_packing_saves_rows_on_short_sequences(arrays):
  wide = widen(arrays, 11)  # rows of 22 tokens, spans of 6 to 10
  pk = layout.pack(wide, mini_batches=1, micro_batches=1)
  assert pk.tokens.shape[2] == 3  # 58 tokens in 3 rows, not 8
  assert layout.packed_tokens(pk) == 58
  assert pk.segment_ids.max() >= 2
