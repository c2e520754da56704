"""Test-wide setup: 8 fake CPU devices, and the golden conformance summary.

The device count must be set before any backend initialises, so it lives here
and nowhere else; tests that need another count run a subprocess.
"""

import collections

import jax
import pytest

jax.config.update('jax_num_cpu_devices', 8)
jax.config.update('jax_platforms', 'cpu')

_FRAMEWORKS = (
  'verl',
  'skyrl',
  'slime',
  'prime',
  # 2026 frontier sets (tests/golden/frontier/, shared/golden/frontier/).
  'frontier/areal',
  'frontier/skyrl_frontier',
  'frontier/verl_frontier',
  'frontier/nemo_rl',
  'frontier/slime_frontier',
  'frontier/verl_pr',
)


def pytest_configure(config):
  config.addinivalue_line(
    'markers', 'golden(framework): replays a reference-framework golden case'
  )


def _framework(item: pytest.Item) -> str | None:
  mark = item.get_closest_marker('golden')
  return None if mark is None else mark.args[0]


def pytest_collection_modifyitems(items):
  for item in items:
    fw = _framework(item)
    if fw is not None:
      item.user_properties.append(('golden', fw))


def pytest_terminal_summary(terminalreporter):
  counts = collections.defaultdict(collections.Counter)
  for outcome in ('passed', 'failed', 'skipped', 'xfailed'):
    for rep in terminalreporter.stats.get(outcome, []):
      fw = dict(getattr(rep, 'user_properties', ())).get('golden')
      if fw is not None and (rep.when == 'call' or outcome == 'skipped'):
        counts[fw][outcome] += 1
  if not counts:
    return
  terminalreporter.section('golden conformance per framework')
  for fw in _FRAMEWORKS:
    if fw in counts:
      c = counts[fw]
      terminalreporter.write_line(
        f'{fw.removeprefix("frontier/"):14s} {c["passed"]:4d} passed  {c["failed"]:3d} failed  '
        f'{c["skipped"]:3d} skipped'
      )
