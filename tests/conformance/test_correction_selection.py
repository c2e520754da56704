"""The correction golden cases the framework replays select: all of them,
none twice."""

from tests.helpers import correction_replay as cr


def test_case_selection_is_complete():
  """Every correction case of the golden set is replayed, none twice."""
  counts = {fw: len(cr.case_ids(fw)) for fw in ('verl', 'skyrl', 'slime')}
  # verl: 20 preset corrections, 30 is_grid, 50 rs_grid, 10 is_rs_combo,
  # 3 offpolicy, 2 edge_all_rejected, 23 errors, 34 legacy.
  assert counts == {'verl': 172, 'skyrl': 26, 'slime': 16}, counts
  for fw in counts:
    assert len(set(cr.case_ids(fw))) == counts[fw]
