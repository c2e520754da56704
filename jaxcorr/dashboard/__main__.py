"""`python -m jaxcorr.dashboard --workdir W [W2 ...]`: serve the dashboard
(jaxcorr/dashboard/__init__.py) on http://127.0.0.1:8080.

From a TPU VM: `ssh -L 8080:localhost:8080 <vm>`, then open
http://localhost:8080 on the laptop (one port, plain HTTP requests).
"""

from __future__ import annotations

import argparse
import os
import sys

_LAB = os.path.join(
  os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
  'docs',
  'mismatch_lab',
)


def parse(argv: list[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog='python -m jaxcorr.dashboard')
  p.add_argument(
    '--workdir',
    nargs='+',
    action='extend',
    required=True,
    help='run directories (local or gs://), overlaid',
  )
  p.add_argument(
    '--host',
    default='127.0.0.1',
    help='address to bind (default: this machine only; 0.0.0.0: any)',
  )
  p.add_argument('--port', type=int, default=8080)
  p.add_argument(
    '--lab', default=_LAB, help='mismatch lab results (docs/mismatch_lab)'
  )
  p.add_argument(
    '--poll', type=float, default=5.0, help='seconds between page refreshes'
  )
  args = p.parse_args(argv)
  if not 0 < args.port < 65536:
    p.error(f'--port={args.port}: 1..65535')
  if args.poll <= 0:
    p.error(f'--poll={args.poll}: a positive number of seconds')
  return args


def main(argv: list[str] | None = None) -> None:
  args = parse(sys.argv[1:] if argv is None else argv)
  import uvicorn

  from jaxcorr.dashboard.app import Dashboard

  app = Dashboard(args.workdir, args.lab, args.poll).app()
  print(f'jaxcorr dashboard: http://{args.host}:{args.port}', flush=True)
  uvicorn.run(app, host=args.host, port=args.port, log_level='warning')


if __name__ == '__main__':
  main()
