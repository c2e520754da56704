"""What the metrics of a streaming run (`rollout.mode='stream'`, in-flight
weight swaps) must show; asserted of an in-process run
(tests/train/rollouts/test_stream.py) and of a driver job
(tests/train/rollouts/test_stream_resume.py)."""

from __future__ import annotations


def assert_bounded_and_mixed(rows: list[dict]) -> None:
  """The metrics rows of a streaming run with max_staleness = 2: staleness
  within the bound, nothing dropped, idle fractions in [0, 1], every update
  moving the weights, and rows of two versions in some batch (swaps in
  flight)."""
  for r in rows:
    assert r['rollout/staleness_max'] <= 2
    assert r['rollout/stale_dropped_fraction'] == 0
    assert 0 <= r['stream/engine_idle_fraction'] <= 1
    assert 0 <= r['stream/trainer_idle_fraction'] <= 1
  # Every update moves the weights, so the versions differ.
  assert min(r['actor/grad_norm'] for r in rows) > 0
  # In flight: some batch holds rows sampled by two versions.
  assert max(r['rollout/mixed_version_fraction'] for r in rows) > 0
  assert max(r['stream/swaps_in_flight'] for r in rows) >= 1
