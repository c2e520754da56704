"""Sessions: the rendezvous between an agent's HTTP calls and the trainer's
environment step, and what each session recorded.

An agent's call arrives on the server's event loop; the environment of its
trajectory (a decoder worker thread) takes it with `Session.take`, and
answers it with `Session.answer` after the engine sampled the turn. One
call is open at a time (the agent waits for its reply). The agent's program
ending (or raising) is the last thing a session takes. `close` answers an
open call with an empty turn (`finish_reason='length'`: the trajectory hit
a budget before this turn) and every later call with a 409 error, so an
agent blocked on a reply always wakes up.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import uuid
from collections.abc import Callable
from typing import Any

from jaxcorr.endpoint.protocol import ApiError

Reply = Callable[[int, dict[str, Any]], None]  # (HTTP status, body)


@dataclasses.dataclass
class Call:
  """One HTTP call: its kind ('chat' or 'completion'), the checked request
  and how to answer it."""

  kind: str
  request: Any
  reply: Reply


@dataclasses.dataclass(frozen=True)
class Ended:
  """The agent's program returned `result`."""

  result: Any


@dataclasses.dataclass(frozen=True)
class Raised:
  """The agent's program raised (`describe`d)."""

  error: str


@dataclasses.dataclass
class CallRecord:
  """One answered call: its turn's ids, log-probs (μ) and policy versions,
  and how many tokens of context preceded it in the trajectory."""

  context: int
  ids: list[int]
  logp: list[float]
  versions: list[int]


@dataclasses.dataclass
class SessionRecord:
  """What a session left: its calls and the trajectory they made (None
  when it ended before its first turn), and its failure if any."""

  session: str
  calls: list[CallRecord] = dataclasses.field(default_factory=list)
  trajectory: Any = None
  error: str = ''


class Session:
  def __init__(self, session_id: str, hub: SessionHub):
    self.id, self.hub = session_id, hub
    self.inbox: queue.Queue = queue.Queue()
    self.open: Call | None = None
    self.closed = False
    self._lock = threading.Lock()

  def submit(self, call: Call) -> None:
    """From the server: queue an agent's call (409 once closed)."""
    with self._lock:
      if not self.closed:
        self.inbox.put(call)
        return
    err = ApiError(
      409,
      f'session {self.id!r} has ended (its trajectory is finished)',
      code='session_closed',
    )
    call.reply(err.status, err.body())

  def end(self, item: Ended | Raised) -> None:
    """From the agent's thread: its program is over."""
    self.inbox.put(item)

  def take(self, timeout_s: float) -> Call | Ended | Raised:
    """The agent's next call or its end; TimeoutError after `timeout_s`."""
    try:
      item = self.inbox.get(timeout=timeout_s)
    except queue.Empty:
      raise TimeoutError(
        f'the agent sent no call and did not return in {timeout_s:g} s'
      ) from None
    if isinstance(item, Call):
      self.open = item
    return item

  def answer(self, status: int, body: dict[str, Any]) -> None:
    call, self.open = self.open, None
    if call is not None:
      call.reply(status, body)

  def close(self, empty_turn: Callable[[Call], dict[str, Any]]) -> None:
    """End the session: the open call gets `empty_turn(call)`, queued
    calls a 409."""
    with self._lock:
      self.closed = True
    if self.open is not None:
      self.answer(200, empty_turn(self.open))
    while True:
      try:
        item = self.inbox.get_nowait()
      except queue.Empty:
        break
      if isinstance(item, Call):
        self.submit(item)  # closed: a 409
    self.hub.forget(self.id)


class SessionHub:
  """The live sessions by id, and the records of the last `keep` ended
  ones (`record(id)`)."""

  def __init__(self, keep: int = 1024):
    self._live: dict[str, Session] = {}
    self._records: collections.OrderedDict[str, SessionRecord] = (
      collections.OrderedDict()
    )
    self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
    self.keep = keep
    self._lock = threading.Lock()

  def open(self, prefix: str = 's') -> Session:
    session = Session(f'{prefix}-{uuid.uuid4().hex[:16]}', self)
    with self._lock:
      self._live[session.id] = session
    return session

  def get(self, session_id: str) -> Session:
    with self._lock:
      session = self._live.get(session_id)
    if session is None:
      ended = session_id in self._ended
      raise ApiError(
        409 if ended else 404,
        f'session {session_id!r} '
        + ('has ended' if ended else 'is not a live session of the trainer'),
        code='session_closed' if ended else 'session_not_found',
      )
    return session

  def forget(self, session_id: str) -> None:
    with self._lock:
      self._live.pop(session_id, None)
      self._ended[session_id] = None
      while len(self._ended) > self.keep:
        self._ended.popitem(last=False)

  def keep_record(self, record: SessionRecord) -> None:
    with self._lock:
      self._records[record.session] = record
      while len(self._records) > self.keep:
        self._records.popitem(last=False)

  def record(self, session_id: str) -> SessionRecord | None:
    with self._lock:
      return self._records.get(session_id)

  def recent(self, n: int) -> list[SessionRecord]:
    """The records of the last `n` sessions that ended, oldest first."""
    with self._lock:
      return list(self._records.values())[-n:]

  @property
  def live(self) -> int:
    with self._lock:
      return len(self._live)
