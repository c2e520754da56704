"""The notebooks run headless, top to bottom, without a cell error.

Each notebook is executed by nbclient in a fresh kernel of this Python (the
venv's ipykernel), with `JAXCORR_SMALL=1` so it takes the reduced path
(`jaxcorr.lab.SMALL`), and a temporary working directory for everything it
writes. The `python3` kernelspec
runs `sys.executable` (jupyter_client replaces a bare `python` in the
kernel command with it), so the kernel sees the same installed jaxcorr. A
notebook that nobody executes rots: an API rename breaks it silently.
"""

from __future__ import annotations

import pathlib
import time

import nbclient
import nbformat
import pytest

# Imported, not skipped when missing: the test extra installs both, and a
# notebook test that silently skips would let the notebooks rot.

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / 'notebooks'


def _execute(name: str, cwd: pathlib.Path) -> float:
  """Runs notebook `name` in `cwd`; returns its wall time in seconds."""
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  client = nbclient.NotebookClient(
    nb,
    timeout=600,
    kernel_name='python3',
    resources={'metadata': {'path': str(cwd)}},
  )
  t0 = time.perf_counter()
  client.execute()  # raises CellExecutionError naming the failing cell
  return time.perf_counter() - t0


@pytest.fixture
def small_env(monkeypatch, tmp_path):
  """The kernel inherits this process's environment."""
  monkeypatch.setenv('JAXCORR_SMALL', '1')
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  return tmp_path


@pytest.mark.notebook
def test_quickstart(small_env):
  wall = _execute('quickstart.ipynb', small_env)
  assert (small_env / 'quickstart_run' / 'metrics.jsonl').is_file()
  assert (small_env / 'quickstart_hf' / 'config.json').is_file()
  print(f'quickstart.ipynb: {wall:.0f}s')


# Slow (4 small runs and a warm-up): the default run executes a notebook
# end to end with test_quickstart, and tests/lab/test_lab.py checks the lab's
# plan, tables and results files this notebook calls.
@pytest.mark.slow
@pytest.mark.notebook
def test_mismatch_lab(small_env):
  wall = _execute('mismatch_lab.ipynb', small_env)
  out = small_env / 'mismatch_lab_out'
  assert (out / 'results.json').is_file()
  assert (out / 'results.md').is_file()
  print(f'mismatch_lab.ipynb: {wall:.0f}s')
