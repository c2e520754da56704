"""Test-wide setup: 8 fake CPU devices, and the golden conformance summary.

The device count must be set before any backend initialises, so it lives here
and nowhere else; tests that need another count run a subprocess.

Every test session (each pytest-xdist worker its own) keeps JAX's persistent
compilation cache in its temporary directory: the trainer tests build many
Trainers of the same config, whose programs then compile once per session.
Only compiles over a second are stored (JAX's default threshold), so the
many small golden/property programs are neither written nor looked up. A
cache hit loads the executable XLA built for the same program, so results
are the same bit for bit; `JAXCORR_TEST_COMPILE_CACHE=0` turns it off.
"""

import collections
import os

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

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


@pytest.fixture(scope='session', autouse=True)
def _compile_cache(tmp_path_factory):
  if os.environ.get('JAXCORR_TEST_COMPILE_CACHE', '1') == '0':
    yield
    return
  # Per worker: JAX writes cache entries in place, not atomically.
  path = tmp_path_factory.mktemp('jax_compile_cache')
  jax.config.update('jax_compilation_cache_dir', str(path))
  # Collection may have compiled already, which fixes "no cache" for good.
  compilation_cache.reset_cache()
  yield
  jax.config.update('jax_compilation_cache_dir', None)
  compilation_cache.reset_cache()


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
