"""The JSONL of eval samples reads back what it wrote, for any string: the
line separators other readers split on (U+2028, U+2029, U+0085) used to be
written raw, and `read` split the file on them (a JSONDecodeError)."""

from __future__ import annotations

import json
import pathlib

import hypothesis as hp
import hypothesis.strategies as st

from jaxcorr.train.evals import samples_log

SEPARATORS = '\u2028\u2029\x85\n\r\x0b\x0c\x1c\x1d\x1e'


def _row(reply: str) -> dict:
  return {'step': 3, 'set': 'é', 'prompt': 'Q: 1+1=', 'reply': reply}


def test_line_separators_round_trip_one_row_per_line(tmp_path):
  rows = [_row(f'a{c}b') for c in SEPARATORS] + [_row('ünï 数 😀')]
  path = samples_log.write(str(tmp_path), 3, rows)
  assert samples_log.read(str(tmp_path), 3) == rows
  text = pathlib.Path(path).read_text(encoding='utf-8')
  # One physical line per row for any line splitter, non-ASCII kept.
  assert len(text.splitlines()) == len(rows)
  assert [json.loads(line) for line in text.splitlines()] == rows
  assert 'ünï 数 😀' in text


def test_a_lone_surrogate_is_written_not_an_error(tmp_path):
  rows = [_row('x\ud800y')]
  samples_log.write(str(tmp_path), 0, rows)
  assert samples_log.read(str(tmp_path), 0) == rows


@hp.settings(max_examples=60, deadline=None)
@hp.given(
  st.lists(
    st.text(alphabet=st.one_of(st.characters(), st.sampled_from(SEPARATORS))),
    min_size=1,
    max_size=4,
  )
)
def test_any_strings_round_trip(tmp_path_factory, replies):
  directory = str(tmp_path_factory.mktemp('log'))
  rows = [_row(r) for r in replies]
  samples_log.write(directory, 1, rows)
  assert samples_log.read(directory, 1) == rows
