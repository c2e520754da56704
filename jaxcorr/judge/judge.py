"""`Judge`: an LLM judge (generative reward model) as a reward function.

The judge is a model served by jaxcorr's own engine
(`jaxcorr.rollout.engine.PolicyEngine`, driven by
`jaxcorr.rollout.driver.generate`, greedy): `JudgeConfig.model` is a local
Hugging Face checkpoint directory the project loads (its own engine,
built on the first call), or 'policy': the engine the trainer rolls out
with, handed over with `Judge.bind(engine, tokenizer)` (the trainer does it:
`bind_policy_judges`, with `rollout.mode='sync'`). That engine grades
with the weights it holds at the call: the policy version of the last
weight sync, the same weights that sampled the step's replies (in the
async modes a version or more behind the trainer). Its engine must then
not be generating at the same time (rollout.mode='sync': rewards are
scored after the step's rollouts).

As a reward (`register_judge(name, config)`; `isolation='thread'`, since
a worker process would load a model of its own), each scorer call
`judge(response, answer)` queues its row; a batching thread takes what
is queued within `gather_s` (at most `batch_size` rows, and at most as
many as the scorer runs calls at once) and grades them in one `generate`.
Failures are the scorer's to count, like any reward's: an unparseable
verdict, a rubric prompt too long for the engine or a generation that
raises makes the call raise (`reward/failures`), a slow judge runs past
`config.reward.timeout_s` (`reward/timeouts`); none stops the step.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from jaxcorr.config.fields import integer, number, setting, text, validate
from jaxcorr.judge.verdict import (
  DEFAULT_RUBRIC,
  DEFAULT_VERDICT,
  compile_verdict,
  parse_verdict,
)
from jaxcorr.rewards import REWARDS, register

POLICY = 'policy'


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
  """One judge: its model, rubric, verdict parser and batching."""

  model: str = setting(
    POLICY,
    text,
    "'policy' (the trainer's engine, `Judge.bind`) or a local HF "
    'checkpoint directory (served by an engine of its own).',
  )
  rubric: str = setting(
    DEFAULT_RUBRIC,
    text,
    'The judge prompt, str.format-ed with {response} and {answer} '
    '(literal braces doubled).',
  )
  verdict: str = setting(
    DEFAULT_VERDICT, text, 'A regex with one group: the score, or yes/no.'
  )
  max_score: float = setting(
    10.0, number(0, lo_open=True), 'A verdict N scores min(N, this) / this.'
  )
  max_new_tokens: int = setting(32, integer(1), 'Tokens of a judge reply.')
  max_prompt_tokens: int = setting(
    512, integer(8), 'Own engine: the longest rubric prompt, in tokens.'
  )
  batch_size: int = setting(16, integer(1), 'Rows graded in one generate.')
  gather_s: float = setting(
    0.02, number(0), 'Seconds the batcher waits for more rows.'
  )

  def __post_init__(self):
    path = validate(self)
    compile_verdict(self.verdict, f'{path}.verdict')
    try:
      self.rubric.format(response='', answer='')
    except (KeyError, IndexError, ValueError) as e:
      raise ValueError(
        f'{path}.rubric: invalid value {self.rubric[:60]!r} ({e!r}); '
        'allowed: text with {response} and {answer} (other braces doubled)'
      ) from None
    if '{response}' not in self.rubric:
      raise ValueError(
        f'{path}.rubric: invalid value {self.rubric[:60]!r} (no '
        '{response}); allowed: text with {response} and {answer}'
      )


def _own_engine(config: JudgeConfig) -> tuple[Any, Any]:
  """(engine, tokenizer) of the checkpoint `config.model`."""
  from jaxcorr.data.text import make_tokenizer
  from jaxcorr.model import load_hf
  from jaxcorr.rollout.engine import PolicyEngine

  module = load_hf(config.model)
  engine = PolicyEngine(
    module,
    max_concurrent_decodes=config.batch_size,
    max_prefill_length=config.max_prompt_tokens,
    max_target_length=config.max_prompt_tokens + config.max_new_tokens,
  )
  return engine, make_tokenizer(config.model, module.config)


class Judge:
  """The judge of `config`, callable as a reward (module doc).

  `grade(responses, answers)` grades a batch directly: one value in
  [0, 1] or one exception per row. `batch_sizes` lists the size of every
  batch the reward path graded (the last 1000).
  """

  def __init__(self, config: JudgeConfig, engine=None, tokenizer=None):
    self.config = config
    self._verdict = compile_verdict(config.verdict)
    self._engine, self._tokenizer = engine, tokenizer
    self._engine_lock = threading.Lock()
    self._start_lock = threading.Lock()
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._thread: threading.Thread | None = None
    self.batch_sizes: list[int] = []
    self.__name__ = 'judge'  # a reward's name in logs

  def bind(self, engine, tokenizer) -> None:
    """Grades with `engine` (the policy's, for model='policy')."""
    with self._engine_lock:
      self._engine, self._tokenizer = engine, tokenizer

  def _served(self) -> tuple[Any, Any]:
    if self._engine is None:
      if self.config.model == POLICY:
        raise RuntimeError(
          "judge model='policy' has no engine: call Judge.bind(engine, "
          'tokenizer) with the engine the policy rolls out with'
        )
      self._engine, self._tokenizer = _own_engine(self.config)
    return self._engine, self._tokenizer

  def grade(
    self, responses: Sequence[str], answers: Sequence[str]
  ) -> list[float | BaseException]:
    """Each row's score in [0, 1], or the exception that explains why it
    has none (a prompt too long, an unparseable verdict)."""
    from jaxcorr.data.text import stop_ids
    from jaxcorr.rollout import driver

    with self._engine_lock:
      engine, tok = self._served()
      out: list[Any] = [None] * len(responses)
      ids, rows = [], []
      room = min(
        engine.max_prefill_length,
        engine.max_target_length - self.config.max_new_tokens,
      )
      for i, (response, answer) in enumerate(zip(responses, answers)):
        prompt = tok.encode(
          self.config.rubric.format(response=response, answer=answer)
        )
        if len(prompt) > room:
          out[i] = ValueError(
            f'judge prompt of {len(prompt)} tokens > the {room} the engine '
            'holds (JudgeConfig.max_prompt_tokens)'
          )
        else:
          ids.append(prompt)
          rows.append(i)
      if ids:
        batch = driver.generate(
          engine,
          ids,
          max_new_tokens=self.config.max_new_tokens,
          top_k=1,
          stop_token_ids=stop_ids(tok),
        )
        for j, i in enumerate(rows):
          tokens = batch.response_tokens[j][batch.context_mask[j]]
          out[i] = self._parse(tok.decode(tokens.tolist()))
    return out

  def _parse(self, reply: str) -> float | BaseException:
    try:
      return parse_verdict(reply, self._verdict, self.config.max_score)
    except ValueError as e:
      return e

  # ---------------------------------------------------- the reward path

  def __call__(self, response: str, answer: str) -> float:
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._queue.put((response, answer, future))
    self._start()
    value = future.result()
    if isinstance(value, BaseException):
      raise value
    return value

  def _start(self) -> None:
    with self._start_lock:
      if self._thread is None or not self._thread.is_alive():
        self._thread = threading.Thread(
          target=self._serve, name='jaxcorr-judge', daemon=True
        )
        self._thread.start()

  def _gather(self) -> list[tuple]:
    batch = [self._queue.get()]
    deadline = time.monotonic() + self.config.gather_s
    while len(batch) < self.config.batch_size:
      try:
        batch.append(
          self._queue.get(timeout=max(deadline - time.monotonic(), 0))
        )
      except queue.Empty:
        break
    return batch

  def _serve(self) -> None:
    while True:
      batch = [b for b in self._gather() if b[2].set_running_or_notify_cancel()]
      if not batch:
        continue
      self.batch_sizes = [*self.batch_sizes[-999:], len(batch)]
      try:
        values = self.grade([b[0] for b in batch], [b[1] for b in batch])
      except Exception as e:  # the engine failed: every row of the batch
        values = [e] * len(batch)
      for (_, _, future), value in zip(batch, values):
        future.set_result(value)


def bind_policy_judges(
  names: Sequence[str], engine, tokenizer, rollout: Any
) -> None:
  """Binds every judge among the rewards `names` whose model is 'policy'
  to the trainer's rollout `engine` (the trainer calls this once built);
  ValueError unless `rollout.mode` (the run's rollout section) is 'sync',
  where that engine is idle while rewards are scored."""
  rollout_mode = rollout.mode
  for name in names:
    judge = REWARDS.get(name)
    if not isinstance(judge, Judge) or judge.config.model != POLICY:
      continue
    if rollout_mode != 'sync':
      raise ValueError(
        f"config.reward.functions: judge {name!r} has model='policy', which "
        'grades on the rollout engine; allowed with '
        f"config.rollout.mode='sync' only (got {rollout_mode!r})"
      )
    judge.bind(engine, tokenizer)


def register_judge(name: str, config: JudgeConfig) -> Judge:
  """A `Judge` registered as the reward `name` (`config.reward.functions`)."""
  judge = Judge(config)
  # A config file loaded again (a second run in one process) replaces its
  # own judge, never another reward.
  register(name, override=isinstance(REWARDS.get(name), Judge))(judge)
  return judge
