"""Graceful stop on SIGTERM: finish the step, checkpoint, exit.

A preempted Cloud TPU VM (spot / preemptible, maintenance events, GKE node
drains) gets SIGTERM and, after a grace period (about 30 s on TPU VMs, the
pod's `terminationGracePeriodSeconds` on GKE), SIGKILL. Python's default
SIGTERM action kills the process at once, losing everything since the last
periodic checkpoint. `PreemptionGuard` instead installs a handler that only
sets a flag; the host loop polls `should_stop()` after each step and, when
it is true, writes a checkpoint and returns. Nothing else happens inside the
handler: it runs between two bytecodes of whatever the main thread was
doing, where taking locks or touching JAX could deadlock.

Multi-host: every host must stop after the same step, or the ones that go on
hang in the next collective (and a checkpoint needs all hosts). SIGTERM does
not reach all hosts at the same moment, so `should_stop()` all-gathers the
flags and stops everyone if any host was signalled. It is then a collective
itself: every process must call it at the same point of every step.

Signal handlers can only be installed from the main thread. Entered from
another thread the guard installs nothing (logged once) and `requested` only
changes through `request()`.

With `catch_sigint=True` a first Ctrl-C asks for the same graceful stop and
a second one is handled as before the guard (KeyboardInterrupt by default),
for when the checkpoint is not wanted after all. The trainer catches both.

Exit status: a run stopped this way exits with `EXIT_PREEMPTED` (75,
`EX_TEMPFAIL` of sysexits.h: "temporary failure, retry") after its
checkpoint is written, so a scheduler tells it from a finished run (0) and
from a crash (1) and restarts it with the same --workdir.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import jax
import numpy as np
from absl import logging

EXIT_PREEMPTED = 75
"""`jaxcorr.main`'s exit status after a graceful stop (module doc)."""


class PreemptionGuard:
  """Context manager turning SIGTERM (and optionally SIGINT) into a flag.

  Args:
    catch_sigint: also catch the first SIGINT (module doc).
  """

  def __init__(self, *, catch_sigint: bool = False):
    self.catch_sigint = bool(catch_sigint)
    self._requested = False
    self._signal: int | None = None
    self._previous: dict[int, Any] = {}
    self._active = False
    self._logged = False

  @property
  def requested(self) -> bool:
    """Whether a stop was asked for on this process (signal or `request`)."""
    return self._requested

  @property
  def signal_number(self) -> int | None:
    """The signal that set the flag (None: none, or `request()`)."""
    return self._signal

  @property
  def installed(self) -> bool:
    """Whether the handlers are installed (inside `with`, main thread)."""
    return bool(self._previous)

  def request(self) -> None:
    """Ask for a stop as a signal would (tests, or a custom trigger)."""
    self._requested = True

  def should_stop(self) -> bool:
    """Whether to stop after this step: this process's flag, or with several
    processes, whether any process's flag is set (a collective: every
    process must call it at the same step)."""
    stop = self._requested
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils

      flags = multihost_utils.process_allgather(np.asarray(stop, np.int32))
      stop = bool(np.any(np.asarray(flags)))
    if stop and not self._logged:
      self._logged = True
      if self._signal is not None:
        reason = f'signal {signal.Signals(self._signal).name}'
      else:
        reason = 'request()' if self._requested else 'another process'
      logging.warning('stop requested (%s): stopping after this step', reason)
    return stop

  def _handle(self, signum: int, frame: FrameType | None) -> None:
    if signum == signal.SIGINT and self._requested:
      previous = self._previous.get(signal.SIGINT)
      if previous == signal.SIG_IGN:
        return
      if callable(previous):
        previous(signum, frame)
        return
      raise KeyboardInterrupt
    self._requested = True
    if self._signal is None:
      self._signal = signum

  def __enter__(self) -> PreemptionGuard:
    if self._active:
      raise ValueError('PreemptionGuard is not re-entrant')
    self._active = True
    if threading.current_thread() is not threading.main_thread():
      logging.warning(
        'PreemptionGuard entered outside the main thread: no signal handler '
        'installed, SIGTERM keeps its current action'
      )
      return self
    signals = [signal.SIGTERM]
    if self.catch_sigint:
      signals.append(signal.SIGINT)
    for sig in signals:
      self._previous[sig] = signal.getsignal(sig)
      signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, previous in self._previous.items():
      # None: a handler not installed from Python; the default is closest.
      signal.signal(sig, signal.SIG_DFL if previous is None else previous)
    self._previous = {}
    self._active = False
