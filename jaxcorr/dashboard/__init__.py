"""A local web dashboard of runs, trajectories and the mismatch lab
(`python -m jaxcorr.dashboard --workdir W [W2 ...]`, docs/dashboard.md).

    data.py     what a workdir holds (metrics.jsonl tailed, traces, eval
                samples), read through etils.epath: local or gs://
    app.py      the pages and their JSON (Starlette)
    static/     dashboard.js (the pages), uPlot (the charts), the CSS

Why Starlette + uvicorn + uPlot: plain HTTP requests on one port, so it
works unchanged through an SSH tunnel from a TPU VM (no websocket, no
second port, nothing fetched from the internet by the page: uPlot ships
here, vendored from npm, MIT); live by polling (the page asks every
`--poll` seconds, and the server reads only what was appended to
metrics.jsonl since); fast (uPlot draws 10,000-point series in a few
milliseconds on a canvas; a page's JSON is one column lookup). Both Python
libraries are small and well kept (Starlette is FastAPI's core, which the
OpenAI endpoint already uses). Panel / Bokeh need a websocket for their
live updates, and Dash's Plotly bundle is 3.5 MB with SVG plots that slow
down at 10,000 points.
"""
