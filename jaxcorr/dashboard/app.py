"""The dashboard's web app: three pages and the JSON they fetch.

Pages (HTML shells; static/dashboard.js draws them from the JSON):

    /            run overview: reward, eval, correction, staleness, time
    /trajectory  one traced row's tokens, coloured; eval-sample search
    /lab         the mismatch lab's results: a table and its curves

JSON (`run`: the index of a workdir on the command line):

    /api/runs                         each run's status and notes
    /api/series?keys=a,b/*            {run: {key: [steps, values]}}
    /api/latest?keys=staleness/*      each run's last value of the keys
    /api/traces?run=0                 the steps with a trace file
    /api/trace?run=0&step=N           the rows' summaries (no tokens) and
                                      the step's weight quantiles and
                                      staleness histogram
    /api/trace_row?run=0&step=N&row=R one row, every token column
    /api/samples?run=0&step=N&q=text  eval-sample search (first 200 hits)
    /api/lab                          the lab's results folders

A request that fails answers `{"error": "<one line>"}` (HTTP 400 for a bad
argument, 500 otherwise), which the page shows; never a traceback.
"""

from __future__ import annotations

import contextlib
import functools
import html as html_lib
import json
import os
import threading
from typing import Any

from etils import epath
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from jaxcorr.dashboard import data

STATIC = os.path.join(os.path.dirname(__file__), 'static')
PAGES = {'/': 'Overview', '/trajectory': 'Trajectories', '/lab': 'Mismatch lab'}
_SAMPLE_HITS = 200
# The overview's charts: (title, metric patterns); names in
# jaxcorr/losses/correction/metrics.py, rl_step.py and stage.py.
OVERVIEW = (
  ('Reward', ('reward/mean',)),
  ('Evaluation', ('eval/accuracy', 'eval/*pass@*', 'eval/*/accuracy')),
  (
    'Mismatch: k1 and k3 KL(μ‖π_old)',
    ('rollout_corr/kl', 'rollout_corr/k3_kl'),
  ),
  (
    'Effective sample size',
    (
      'rollout_corr/rollout_is_eff_sample_size',
      'rollout_corr/rollout_is_seq_eff_sample_size',
    ),
  ),
  (
    'IS weights: min, mean, max',
    (
      'rollout_corr/rollout_is_min',
      'rollout_corr/rollout_is_mean',
      'rollout_corr/rollout_is_max',
    ),
  ),
  (
    'Rejected fractions',
    (
      'rollout_corr/rejected_token_fraction',
      'rollout_corr/rejected_seq_fraction',
    ),
  ),
  (
    'Staleness (mean, max)',
    ('rollout/staleness_mean', 'rollout/staleness_max'),
  ),
  (
    'Time per phase (s)',
    (
      'time/rollout',
      'time/reward',
      'time/prepare',
      'time/update',
      'time/weight_sync',
      'time/eval',
      'time/trace',
    ),
  ),
)
HISTOGRAMS = 'staleness/*_hist*'  # the staleness buckets' token fractions


class BadRequest(ValueError):
  """A request argument that is missing or wrong (HTTP 400)."""


def _page(path: str, title: str, poll_s: float) -> HTMLResponse:
  nav = ' '.join(
    f'<a href="{p}"{" class=here" if p == path else ""}>{t}</a>'
    for p, t in PAGES.items()
  )
  overview = html_lib.escape(json.dumps(OVERVIEW), quote=True)
  html = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>jaxcorr · {title}</title>
<link rel="stylesheet" href="/static/uPlot.min.css">
<link rel="stylesheet" href="/static/dashboard.css">
<script src="/static/uPlot.iife.min.js"></script>
<script src="/static/dashboard.js" data-overview='{overview}'
  data-histograms="{HISTOGRAMS}"></script></head>
<body data-page="{path}" data-poll="{poll_s}">
<header><b>jaxcorr</b> {nav}</header>
<div id="notes"></div><main id="app"></main>
</body></html>"""
  return HTMLResponse(html)


def _int(request: Request, name: str) -> int:
  value = request.query_params.get(name)
  try:
    return int(value)
  except (TypeError, ValueError):
    raise BadRequest(f'{name}={value!r}: an integer is needed') from None


def _json(x: Any) -> JSONResponse:
  return JSONResponse(x)


class Dashboard:
  """The app of `runs` (workdirs) and `lab` (results folders)."""

  def __init__(self, workdirs: list[str], lab_dir: str, poll_s: float = 5.0):
    names = [os.path.basename(str(w).rstrip('/')) or str(w) for w in workdirs]
    self.runs = [
      data.Run(w, n if names.count(n) == 1 else f'{n} ({i})')
      for i, (w, n) in enumerate(zip(workdirs, names))
    ]
    self.lab_dir = lab_dir
    self.poll_s = poll_s

  def run(self, request: Request) -> data.Run:
    i = _int(request, 'run')
    if not 0 <= i < len(self.runs):
      raise BadRequest(f'run={i}: runs are 0..{len(self.runs) - 1}')
    return self.runs[i]

  # -------------------------------------------------------------- api

  async def api_runs(self, request: Request) -> JSONResponse:
    return _json({'runs': [r.status() for r in self.runs]})

  def _keys(self, request: Request) -> list[str]:
    keys = [k for k in request.query_params.get('keys', '').split(',') if k]
    if not keys:
      raise BadRequest('keys=: name one metric or pattern at least')
    return keys

  async def api_series(self, request: Request) -> JSONResponse:
    keys = self._keys(request)
    out = []
    for r in self.runs:
      r.metrics.refresh() if r.workdir.exists() else None
      out.append(r.metrics.series(keys))
    return _json({'runs': out})

  async def api_latest(self, request: Request) -> JSONResponse:
    keys = self._keys(request)
    return _json({'runs': [r.metrics.latest(keys) for r in self.runs]})

  async def api_traces(self, request: Request) -> JSONResponse:
    run = self.run(request)
    return _json({'steps': run.trace_steps(), 'eval_steps': run.eval_steps()})

  def _trace(self, request: Request) -> list[dict]:
    run, step = self.run(request), _int(request, 'step')
    if step not in run.trace_steps():
      raise BadRequest(f'step={step}: no trace file (train.trace_every)')
    return run.trace_rows(step)

  async def api_trace(self, request: Request) -> JSONResponse:
    rows = self._trace(request)
    return _json(
      {
        'rows': [data.row_summary(r) for r in rows],
        'summary': data.step_summary(rows),
      }
    )

  async def api_trace_row(self, request: Request) -> JSONResponse:
    row = _int(request, 'row')
    for r in self._trace(request):
      if r.get('row') == row:
        return _json(r)
    raise BadRequest(f'row={row}: not in this trace step')

  async def api_samples(self, request: Request) -> JSONResponse:
    run, step = self.run(request), _int(request, 'step')
    if step not in run.eval_steps():
      raise BadRequest(f'step={step}: no eval samples at this step')
    q = request.query_params.get('q', '')
    total, hits = data.search_samples(run.eval_rows(step), q, _SAMPLE_HITS)
    return _json({'matches': total, 'rows': hits})

  async def api_lab(self, request: Request) -> JSONResponse:
    return _json({'folders': lab_folders(self.lab_dir)})

  # ------------------------------------------------------------ app

  def warm_up(self) -> None:
    """Read every run's metrics and the lab's results now, on a thread:
    the first page finds them parsed (or waits on the reader's lock)."""

    def read():
      for r in self.runs:
        r.status()
      lab_folders(self.lab_dir)

    threading.Thread(target=read, daemon=True).start()

  def app(self) -> Starlette:
    def page(path, title):
      async def handler(request):
        return _page(path, title, self.poll_s)

      return handler

    api = {
      'runs': self.api_runs,
      'series': self.api_series,
      'latest': self.api_latest,
      'traces': self.api_traces,
      'trace': self.api_trace,
      'trace_row': self.api_trace_row,
      'samples': self.api_samples,
      'lab': self.api_lab,
    }
    routes = [Route(p, page(p, t)) for p, t in PAGES.items()]
    routes += [Route(f'/api/{k}', v) for k, v in api.items()]
    routes.append(Mount('/static', StaticFiles(directory=STATIC)))

    @contextlib.asynccontextmanager
    async def lifespan(app):
      self.warm_up()
      yield

    return Starlette(
      routes=routes,
      lifespan=lifespan,
      exception_handlers={Exception: _error, BadRequest: _error},
    )


async def _error(request: Request, exc: Exception) -> JSONResponse:
  """One line for the page: the request's fault (400) or ours (500)."""
  code = 400 if isinstance(exc, BadRequest) else 500
  what = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
  return JSONResponse({'error': what}, status_code=code)


@functools.lru_cache(maxsize=8)
def _lab_records(path: str, mtime: float) -> list[dict]:
  from jaxcorr.lab import load_results  # 4 s of imports: on use

  return load_results(path)


def lab_folders(lab_dir: str) -> list[dict[str, Any]]:
  """Each folder under `lab_dir` (itself included) with a results.json:
  its name and records (`jaxcorr.lab.results.load_results`)."""
  root = epath.Path(lab_dir)
  if not root.exists():
    return []
  found = [root, *sorted(p for p in root.iterdir() if p.is_dir())]
  out = []
  for folder in found:
    path = folder / 'results.json'
    if path.exists():
      records = _lab_records(str(path), path.stat().mtime)
      name = folder.name if folder != root else root.name or str(root)
      out.append({'name': name, 'runs': records})
  return out
