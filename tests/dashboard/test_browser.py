"""The dashboard in a real browser: Debian's headless Chromium, driven by
selenium through the system chromedriver, on a workdir written by the
trainer's writers (tests/helpers/dashboard_workdir.py), a half-written one
and a missing one.

Without chromium + chromium-driver: a failure under CI=true (the Makefile
installs them), a skip elsewhere. `DASHBOARD_SCREENSHOTS=<dir>` keeps the
screenshots there (docs/dashboard/*.png are made so); otherwise they go to
the test's tmp_path.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from jaxcorr.dashboard.app import Dashboard
from tests.helpers import dashboard_workdir as wd

CHROMIUM, DRIVER = '/usr/bin/chromium', '/usr/bin/chromedriver'
STEPS = 40
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _need_browser() -> None:
  if os.path.exists(CHROMIUM) and os.path.exists(DRIVER):
    return
  why = (
    f'{CHROMIUM} / {DRIVER} missing (apt-get install chromium chromium-driver)'
  )
  if os.environ.get('CI', '').lower() in ('1', 'true', 'yes'):
    pytest.fail(f'CI={os.environ["CI"]}: {why}', pytrace=False)
  pytest.skip(why)


@pytest.fixture(scope='module')
def server(tmp_path_factory):
  """The dashboard of [a run, a half-written run, a missing run] on a free
  local port, in a thread of this process."""
  import uvicorn

  root = tmp_path_factory.mktemp('dash')
  run, half = str(root / 'tiny_run'), str(root / 'half_run')
  wd.write_workdir(run, STEPS)
  os.makedirs(half)
  with open(os.path.join(half, 'metrics.jsonl'), 'w') as f:
    f.write('{"step": 1, "reward/mean": 0.25}\n{"step": 2, "rew')
  lab = os.path.join(ROOT, 'docs', 'mismatch_lab')
  app = Dashboard([run, half, str(root / 'missing')], lab).app()
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  srv = uvicorn.Server(
    uvicorn.Config(app, host='127.0.0.1', port=port, log_level='warning')
  )
  thread = threading.Thread(target=srv.run, daemon=True)
  thread.start()
  while not srv.started:
    time.sleep(0.02)
  yield f'http://127.0.0.1:{port}'
  srv.should_exit = True
  thread.join(5)


@pytest.fixture(scope='module')
def browser():
  _need_browser()
  from selenium import webdriver
  from selenium.webdriver.chrome.service import Service

  opts = webdriver.ChromeOptions()
  opts.binary_location = CHROMIUM
  for arg in ('--headless=new', '--no-sandbox', '--disable-dev-shm-usage'):
    opts.add_argument(arg)
  opts.add_argument('--window-size=1400,1000')
  # The system chromedriver: selenium's manager would download one.
  driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
  yield driver
  driver.quit()


@pytest.fixture(scope='module')
def shots(tmp_path_factory):
  out = os.environ.get('DASHBOARD_SCREENSHOTS') or str(
    tmp_path_factory.mktemp('shots')
  )
  os.makedirs(out, exist_ok=True)
  return out


def _open(browser, url: str) -> None:
  from selenium.webdriver.support.ui import WebDriverWait

  browser.get(url)
  WebDriverWait(browser, 15).until(
    lambda d: d.find_element('tag name', 'body').get_attribute('data-ready')
  )


def _wait_for(browser, css: str):
  from selenium.webdriver.support.ui import WebDriverWait

  return WebDriverWait(browser, 10).until(
    lambda d: d.find_elements('css selector', css)
  )[0]


def test_overview_draws_the_runs_points(server, browser, shots):
  _open(browser, server + '/')
  box = browser.find_element('css selector', '.chart[data-title="Reward"]')
  steps, *lines = json.loads(box.get_attribute('data-points'))
  assert steps == list(range(1, STEPS + 1))
  # The run's curve, and the half-written run's one complete line.
  ours = [v for v in lines if v[-1] is not None]
  assert ours == [[wd.reward_at(s) for s in steps]]
  assert [v[0] for v in lines if v[-1] is None] == [0.25]
  assert box.find_elements('tag name', 'canvas')  # uPlot drew it
  notes = browser.find_element('id', 'notes').text
  assert 'half_run: metrics.jsonl: the last line is being written' in notes
  assert 'missing: ' in notes and 'no such directory' in notes
  assert 'Traceback' not in browser.page_source
  browser.save_screenshot(os.path.join(shots, 'overview.png'))


def test_trajectory_colours_a_token_by_its_weight(server, browser, shots):
  from selenium.webdriver.support.ui import Select

  _open(browser, server + '/trajectory')
  _wait_for(browser, f'tr[data-row="{wd.KNOWN_ROW}"]').click()
  Select(browser.find_element('id', 'mode')).select_by_value('weight')
  token = _wait_for(browser, f'.tok[data-t="{wd.KNOWN_TOKEN}"]')
  assert token.text == wd.KNOWN_PIECE
  # log(2) / scale log(2) = 1: full red, 255·(1 − 0.75) = 64.
  assert (
    token.value_of_css_property('background-color') == 'rgba(255, 64, 64, 1)'
  )
  env = browser.find_elements('css selector', '.tok.env')
  assert len(env) == 2  # the row's two environment tokens
  q = browser.find_element('id', 'q')
  q.send_keys('13+')
  from selenium.webdriver.support.ui import WebDriverWait

  hits = WebDriverWait(browser, 10).until(
    lambda d: (
      (t := d.find_element('id', 'hits').text).startswith('1 match') and t
    )
  )
  assert '13+13=' in hits and '3+3=' not in hits.replace('13+13=', '')
  browser.save_screenshot(os.path.join(shots, 'trajectory.png'))


def test_lab_table_and_curves(server, browser, shots):
  _open(browser, server + '/lab')
  rows = browser.find_elements('css selector', '#lab-table tr')
  assert len(rows) > 5
  assert browser.find_elements('css selector', '#lab-plot canvas')
  browser.save_screenshot(os.path.join(shots, 'lab.png'))


def test_a_bad_request_is_one_line_in_the_page(server, browser):
  browser.get(server + '/api/trace?run=0&step=999')
  body = browser.find_element('tag name', 'body').text
  assert json.loads(body) == {
    'error': 'step=999: no trace file (train.trace_every)'
  }
