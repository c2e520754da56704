"""`python -m jaxcorr.parity` on the tiny model: the real engine and the
trainer's π_old, one table row per setting, the files of --out."""

import json
import os
import subprocess
import sys

from jaxcorr.parity import report
from jaxcorr.parity import settings as settings_lib
from jaxcorr.parity.__main__ import cli_plan, run_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _read(path: str, mode: str = 'r'):
  with open(path, mode) as f:
    return f.read()


def test_fp32_and_bf16_engine_rows_on_the_tiny_model(tmp_path):
  config = settings_lib.load_config('arith_tiny', 'pulse')
  config.train.sft_steps = 0
  plan = cli_plan(config, ['fp32', 'bf16_engine'], 2, 'tiny')
  assert [c.rollout.engine_dtype for _, _, c in plan] == [
    'float32',
    'bfloat16',
  ]
  assert {c.model.dtype for _, _, c in plan} == {'float32'}
  fp32, bf16 = (r['bands'] for r in run_plan(plan, str(tmp_path)))
  # 2 prompts x 4 samples, up to 5 response tokens each.
  assert 0 < fp32['tokens'] <= 40 and fp32['sequences'] == 8
  assert fp32['token_0.1%'] == 1 and fp32['max_abs_dlogp'] < 1e-4
  assert 0 < fp32['bitwise'] <= 1 and fp32['argmax'] == 1
  # A bf16 engine moves μ, not the tokens π_old scores.
  assert bf16['max_abs_dlogp'] > 10 * fp32['max_abs_dlogp']
  assert bf16['bitwise'] < fp32['bitwise']
  records = [dict(setting='fp32', what='', model='tiny', seconds=1.0)]
  records[0]['bands'] = fp32
  paths = report.write(records, str(tmp_path / 'out'))
  assert [os.path.basename(p) for p in paths] == [
    'results.json',
    'results.md',
    'parity.png',
  ]
  assert json.loads(_read(paths[0]))[0]['bands'] == fp32
  assert '| `fp32` | tiny |' in _read(paths[1])
  assert _read(paths[2], 'rb')[:8] == b'\x89PNG\r\n\x1a\n'


def test_an_unknown_setting_is_one_line():
  proc = subprocess.run(
    [sys.executable, '-m', 'jaxcorr.parity', '--settings=fp32,fp4'],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [
    'error: --settings: unknown fp4; allowed: '
    + ', '.join(s.name for s in settings_lib.SETTINGS)
  ]
