"""`ToolRunner`: every tool call run with a timeout, its failures contained
and counted, as `RewardScorer` contains reward functions
(jaxcorr/rewards/scorer.py).

A call runs on a `WorkerPool` thread (jaxcorr/rewards/workers.py): one that
runs past `timeout_s` is abandoned and its thread replaced, so a hanging
tool never blocks the rollout; a tool with `MAX_STUCK` abandoned calls
still running gets no new ones (they time out at once). Each call ends in
one outcome, which is both counted and told to the agent as the tool's
message:

    ok         the tool returned a string (or an int / float, shown as text)
    unknown    no tool of that name
    arguments  the arguments do not match the tool's JSON schema
    error      the tool raised
    timeout    past `timeout_s`, or skipped for `MAX_STUCK`
    garbage    the tool returned something else (None, bytes, an object),
               or text longer than `max_chars`

Only `ok` is the tool's answer; the others read `error: <why>`.

Environments run calls through a `ToolSession` (`runner.session()`), one
per trajectory: its `counts` are that trajectory's outcomes, so a step's
`agent/tool_<outcome>` counts are those of its own trajectories (they sum
to `agent/tool_calls`), never calls made elsewhere on the shared runner
(the SFT warm-up's demonstrations, an evaluation, another draw).
"""

from __future__ import annotations

import collections
import concurrent.futures
import numbers
import threading
from collections.abc import Sequence
from typing import Any

from jaxcorr.agents.tool_calls import ToolCall
from jaxcorr.agents.tools import Tool, ToolArgumentError
from jaxcorr.rewards import MAX_STUCK
from jaxcorr.rewards.workers import WorkerPool

OUTCOMES = ('ok', 'unknown', 'arguments', 'error', 'timeout', 'garbage')


class ToolRunner:
  """Runs calls of `tools` (thread-safe; one pool for all environments).

  Args:
    tools: the tools by name.
    timeout_s: seconds per call (> 0).
    max_chars: longest accepted result.
    workers: pool threads.
  """

  def __init__(
    self,
    tools: Sequence[Tool],
    *,
    timeout_s: float = 5.0,
    max_chars: int = 2000,
    workers: int = 4,
  ):
    if not timeout_s > 0:
      raise ValueError(f'timeout_s must be > 0, got {timeout_s}')
    self.tools = {t.name: t for t in tools}
    self.timeout_s, self.max_chars = timeout_s, max_chars
    self._pool = WorkerPool(workers)
    self._lock = threading.Lock()
    self.counts: collections.Counter[str] = collections.Counter()

  def run(self, call: ToolCall) -> tuple[str, str]:
    """(the tool message's content, the outcome)."""
    content, outcome = self._run(call)
    with self._lock:
      self.counts[outcome] += 1
    return content, outcome

  def _run(self, call: ToolCall) -> tuple[str, str]:
    tool = self.tools.get(call.name)
    if tool is None:
      known = ', '.join(sorted(self.tools)) or 'none'
      return f'error: unknown tool {call.name!r} (tools: {known})', 'unknown'
    try:
      args = call.arguments
      if call.text is not None:
        args = {**args, **tool.text_arguments(call.text)}
      args = tool.check_arguments(args)
    except ToolArgumentError as err:
      return f'error: {err}', 'arguments'
    if self._pool.stuck(tool.name) >= MAX_STUCK:
      return f'error: {tool.name} timed out', 'timeout'
    task = self._pool.submit(tool.name, lambda: tool.fn(**args))
    try:
      value = task.future.result(timeout=self.timeout_s)
    except concurrent.futures.TimeoutError:
      self._pool.abandon(task)
      return f'error: {tool.name} timed out after {self.timeout_s}s', 'timeout'
    except Exception as err:  # the tool's own failure, told to the agent
      return f'error: {type(err).__name__}: {err}'[: self.max_chars], 'error'
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
      value = str(value)
    if not isinstance(value, str) or len(value) > self.max_chars:
      return f'error: {tool.name} returned no usable text', 'garbage'
    return value, 'ok'

  def session(
    self, tokenizer: Any = None, counts: collections.Counter | None = None
  ) -> ToolSession:
    """One trajectory's handle on this runner (module docstring)."""
    return ToolSession(self, tokenizer, counts)

  def take_counts(self) -> dict[str, int]:
    """Calls per outcome since the last take, over every session (every
    outcome present)."""
    with self._lock:
      out = {k: self.counts.get(k, 0) for k in OUTCOMES}
      self.counts.clear()
    return out

  def close(self) -> None:
    self._pool.close()


class ToolSession:
  """What `EnvironmentSpec.make` is given for one trajectory.

  Attributes:
    tools: the tools by name.
    tokenizer: the trainer's tokenizer (`encode(text, bos=False)`,
      `decode(ids)`), for an environment whose observations are token ids;
      None outside the trainer.
    counts: this trajectory's calls per outcome.
  """

  def __init__(
    self,
    runner: ToolRunner,
    tokenizer: Any = None,
    counts: collections.Counter | None = None,
  ):
    self.runner, self.tokenizer, self.tools = runner, tokenizer, runner.tools
    self.counts = collections.Counter() if counts is None else counts
    self._lock = threading.Lock()

  def run(self, call: ToolCall) -> tuple[str, str]:
    """`ToolRunner.run`, counted for this trajectory."""
    content, outcome = self.runner.run(call)
    with self._lock:
      self.counts[outcome] += 1
    return content, outcome
