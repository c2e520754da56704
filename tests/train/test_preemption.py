"""PreemptionGuard: SIGTERM sets a flag instead of killing the process,
handlers are restored, multi-process agreement."""

from __future__ import annotations

import os
import signal
import threading

import jax
import numpy as np
import pytest
from jax.experimental import multihost_utils

from jaxcorr.train import preemption


@pytest.fixture
def previous_handlers():
  """Known, distinct SIGTERM / SIGINT handlers, put back after the test."""
  calls = []

  def term(signum, frame):
    calls.append(('term', signum))

  def intr(signum, frame):
    calls.append(('int', signum))

  saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
  signal.signal(signal.SIGTERM, term)
  signal.signal(signal.SIGINT, intr)
  yield term, intr, calls
  for s, h in saved.items():
    signal.signal(s, h)


def test_sigterm_sets_flag_and_handler_is_restored(previous_handlers):
  term, intr, calls = previous_handlers
  with preemption.PreemptionGuard() as guard:
    assert guard.installed
    assert signal.getsignal(signal.SIGTERM) == guard._handle
    assert signal.getsignal(signal.SIGINT) is intr  # not caught by default
    assert not guard.requested and not guard.should_stop()
    os.kill(os.getpid(), signal.SIGTERM)
    # The process is alive and only the flag changed.
    assert guard.requested
    assert guard.signal_number == signal.SIGTERM
    assert guard.should_stop()
    os.kill(os.getpid(), signal.SIGTERM)  # a second one is harmless
    assert guard.requested
  assert not guard.installed
  assert signal.getsignal(signal.SIGTERM) is term
  assert signal.getsignal(signal.SIGINT) is intr
  assert calls == []  # the previous handler never ran inside the guard
  assert guard.requested  # the flag outlives the block
  os.kill(os.getpid(), signal.SIGTERM)
  assert calls == [('term', signal.SIGTERM)]


def test_sigint_once_graceful_twice_previous_handler(previous_handlers):
  _, intr, calls = previous_handlers
  with preemption.PreemptionGuard(catch_sigint=True) as guard:
    assert signal.getsignal(signal.SIGINT) == guard._handle
    os.kill(os.getpid(), signal.SIGINT)
    assert guard.requested and guard.signal_number == signal.SIGINT
    assert calls == []
    os.kill(os.getpid(), signal.SIGINT)
    assert calls == [('int', signal.SIGINT)]
  assert signal.getsignal(signal.SIGINT) is intr


def test_second_sigint_raises_keyboard_interrupt_by_default():
  saved = signal.getsignal(signal.SIGINT)
  signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    with preemption.PreemptionGuard(catch_sigint=True) as guard:
      os.kill(os.getpid(), signal.SIGINT)
      assert guard.requested
      with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
  finally:
    signal.signal(signal.SIGINT, saved)


def test_request_and_reentry():
  guard = preemption.PreemptionGuard()
  assert not guard.should_stop()
  guard.request()
  assert guard.requested and guard.should_stop()
  assert guard.signal_number is None
  with guard, pytest.raises(ValueError, match='not re-entrant'):
    guard.__enter__()


def test_outside_main_thread_installs_nothing(previous_handlers):
  term, _, _ = previous_handlers
  seen = {}

  def run():
    with preemption.PreemptionGuard() as guard:
      seen['installed'] = guard.installed
      seen['handler'] = signal.getsignal(signal.SIGTERM)
      guard.request()
      seen['stop'] = guard.should_stop()

  t = threading.Thread(target=run)
  t.start()
  t.join()
  assert seen == {'installed': False, 'handler': term, 'stop': True}
  assert signal.getsignal(signal.SIGTERM) is term


def test_should_stop_agrees_across_processes(monkeypatch):
  """Two processes, only the other one signalled: both stop."""
  gathered = []

  def allgather(x):
    gathered.append(np.asarray(x))
    return np.stack([np.asarray(x), np.asarray(1, np.int32)])

  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  monkeypatch.setattr(multihost_utils, 'process_allgather', allgather)
  guard = preemption.PreemptionGuard()
  assert guard.should_stop()
  assert not guard.requested
  assert len(gathered) == 1 and int(gathered[0]) == 0

  monkeypatch.setattr(
    multihost_utils,
    'process_allgather',
    lambda x: np.stack([np.asarray(x)] * 2),
  )
  assert not preemption.PreemptionGuard().should_stop()
