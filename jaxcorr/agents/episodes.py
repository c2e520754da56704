"""`AgentRollouts`: the trainer's multi-turn sampler. Rows in, one
trajectory per (row, sample) out, as a `RolloutBatch` with an agent mask,
the final answers to score, the turn rewards and the rollout metrics
(`AgentBatch`).

    episodes(rows, keys)   one `Episode` per (row, sample)
    decoder(sp)            an `AgentDecoder` to run them on
    collect(finished)      the `AgentBatch` of finished episodes
    sample(rows)           the three in one pass (sync and fixed-lag
                           modes); the streaming producer calls them
                           itself, one decoder for the run, episodes of
                           several draws in flight

It owns what lives across steps: the environment spec, the `ToolRunner`
(threads; each trajectory runs its calls through its own `ToolSession`,
so its outcome counts are its own), the turn format and the compiled
`Continuation`. Environment failures (jaxcorr/agents/failures.py) end
their trajectories; `collect` and `demonstrations` stop the run when a
batch has more than `config.agent.max_env_error_fraction` of them. Keys:
trajectory (row i, sample s) samples turn t with
fold_in(fold_in(fold_in(PRNGKey(seed), first_prompt + i), s), t), the keys
of `rollout.driver.request_keys` folded with the turn, so a step's
trajectories depend only on its seed and weights (exact resume).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from absl import logging

from jaxcorr.agents.config import AgentConfig
from jaxcorr.agents.continuation import Continuation, cache_headroom
from jaxcorr.agents.demonstrations import (
  Demonstration,
  demonstrate,
  turn_end_id,
)
from jaxcorr.agents.driver import AgentDecoder, Episode, TurnLimits
from jaxcorr.agents.environment import environment_spec
from jaxcorr.agents.failures import check_bound, describe
from jaxcorr.agents.tool_runner import OUTCOMES, ToolRunner
from jaxcorr.agents.trajectory import Trajectory, to_batch
from jaxcorr.agents.turns import ARITH_TOOL_TEMPLATE, TurnFormat
from jaxcorr.data.chat import ChatTemplate
from jaxcorr.data.tasks import Example
from jaxcorr.rollout import RolloutBatch
from jaxcorr.rollout.driver import request_keys
from jaxcorr.rollout.engine import PolicyEngine
from jaxcorr.rollout.precision import stored_dtypes
from jaxcorr.rollout.state import SamplingParams

SUM_METRICS = (
  'agent/tool_calls',
  'agent/malformed_calls',
  'agent/env_errors',
  'agent/long_observations',
  *(f'agent/tool_{o}' for o in OUTCOMES),
)
"""Metrics that are counts over the rows (the others are means)."""


def turn_template(cfg: AgentConfig, hf_path: str) -> ChatTemplate:
  """The chat template `config.agent.chat_template` names."""
  if cfg.chat_template == 'arith':
    return ChatTemplate(ARITH_TOOL_TEMPLATE)
  if not hf_path:
    raise ValueError(
      "config.agent.chat_template: invalid value 'model' without "
      "config.model.hf_path; allowed: 'arith' for a model from scratch"
    )
  return ChatTemplate.from_dir(hf_path)


def engine_headroom(cfg: AgentConfig) -> int:
  """Cache positions the engine needs past prompt + response for the
  continuations (0 when agents are off)."""
  if not cfg.enabled or not cfg.kv_reuse:
    return 0
  return cache_headroom(cfg.max_env_tokens + 1)


def engine_prefill(cfg: AgentConfig, prompt: int, response: int) -> int:
  """The engine's longest prefill: the prompt, or with `kv_reuse=False`
  a whole history (prompt + response)."""
  if cfg.enabled and not cfg.kv_reuse:
    return prompt + response
  return prompt


class AgentBatch(NamedTuple):
  """Finished trajectories, as the trainer scores them."""

  batch: RolloutBatch
  finals: list[str]  # [B] the last agent turns' texts (what is scored)
  turn_rewards: np.ndarray  # [B] float32 the sum of each one's turn rewards
  metrics: dict[str, float]  # `trajectory_metrics` and the tool counts


class AgentRollouts:
  """Multi-turn sampling over one engine (module docstring).

  Args:
    cfg: the `agent` section.
    engine: the rollout engine (cache with `engine_headroom`).
    tokenizer: the trainer's tokenizer (`encode(text, bos=)`, `decode`).
    template: the chat template of the turns.
    stop_ids: ids that end an agent turn.
    prompt_length, response_length: the batch's P and T.
  """

  def __init__(
    self,
    cfg: AgentConfig,
    engine: PolicyEngine,
    tokenizer: Any,
    template: ChatTemplate,
    stop_ids: Sequence[int],
    *,
    prompt_length: int,
    response_length: int,
  ):
    self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
    self.spec = environment_spec(cfg.environment, cfg)
    self.runner = ToolRunner(
      self.spec.tools, timeout_s=cfg.tool_timeout_s, workers=cfg.env_workers
    )
    self.turns = TurnFormat(template, tokenizer)
    self.stop_ids = tuple(stop_ids)
    self.prompt_length, self.response_length = prompt_length, response_length
    self.continuation = Continuation(engine) if cfg.kv_reuse else None
    self.limits = TurnLimits(
      turn_tokens=cfg.turn_tokens,
      max_turns=cfg.max_turns,
      response_length=response_length,
      env_tokens=cfg.max_env_tokens,
    )

  def decoder(self, sp: SamplingParams) -> AgentDecoder:
    """A decoder of trajectories over the engine (one per sampling pass,
    or one for a whole stream)."""
    return AgentDecoder(
      self.engine,
      self.turns,
      self.tokenizer.decode,
      sp=sp,
      limits=self.limits,
      stop_token_ids=self.stop_ids,
      continuation=self.continuation,
      env_workers=self.cfg.env_workers,
    )

  def episodes(
    self,
    examples: Sequence[Example],
    keys: np.ndarray,
    num_samples: int,
    *,
    tag: Any = None,
  ) -> list[Episode]:
    """One episode per (row, sample), row i * num_samples + s with key
    `keys[row]` (`request_keys`); `tag` marks them (the stream's draw).
    An environment whose `make` or `reset` raises gives a failed episode
    (no prompt, no turn: the decoder hands it back as it is)."""
    out = []
    for i, ex in enumerate(examples):
      prompt = None
      for s in range(num_samples):
        row = i * num_samples + s
        tr = Trajectory(row=row, group=i, sample=s, prompt=[])
        env = self._reset(tr, ex)
        if env is not None:
          self._check_prompt(tr.prompt, ex)
          # Samples of a row share one prefill of their prompt.
          prompt = prompt if prompt == tr.prompt else tr.prompt
          tr.prompt = prompt
        out.append(Episode(tr, env, keys[row], tag=tag))
    return out

  def _reset(self, tr: Trajectory, ex: Example):
    """A fresh environment for `tr`, its prompt in `tr.prompt`; None when
    the environment failed (recorded in `tr`)."""
    stage = 'make'
    try:
      env = self.spec.make(
        self.runner.session(self.tokenizer, tr.tool_outcomes)
      )
      stage = 'reset'
      opening = env.reset(ex)
      # Messages go through the chat template; ids (an OpenAI completions
      # prompt, jaxcorr/endpoint) are the prompt as they are.
      if opening and not isinstance(opening[0], dict):
        tr.prompt = [int(i) for i in opening]
      else:
        tr.prompt = self.turns.prompt_ids(opening)
    except Exception as err:  # the environment's failure: contained
      tr.fail(describe(stage, err))
      return None
    return env

  def collect(
    self,
    done: Sequence[Episode],
    sp: SamplingParams,
    *,
    env_time_share: float,
  ) -> AgentBatch:
    """Finished episodes (any order) as a batch in row order, with the
    final answers, turn rewards and metrics (the tool calls are those of
    these trajectories). `EnvironmentFailing` when more than
    `max_env_error_fraction` of them failed. An environment with a
    `finish(trajectory)` method is told its trajectory is over (the
    endpoint's sessions record it and end)."""
    for e in done:
      _finish(e)
    trajectories = sorted((e.trajectory for e in done), key=lambda t: t.row)
    check_bound(
      self.cfg.environment,
      [t.error for t in trajectories if t.error],
      len(trajectories),
      self.cfg.max_env_error_fraction,
      'trajectories',
    )
    batch = to_batch(
      trajectories,
      prompt_length=self.prompt_length,
      response_length=self.response_length,
      sp=sp,
      drop_truncated=self.cfg.drop_truncated,
      **stored_dtypes(self.engine),
    )
    metrics = trajectory_metrics(trajectories)
    metrics['agent/env_time_share'] = env_time_share
    return AgentBatch(
      batch,
      [t.final_text for t in trajectories],
      np.asarray([t.reward for t in trajectories], np.float32),
      metrics,
    )

  def sample(
    self,
    examples: Sequence[Example],
    *,
    num_samples: int,
    sp: SamplingParams,
    seed: int,
    first_prompt: int = 0,
  ) -> AgentBatch:
    """Every trajectory of `examples`, sampled to the end."""
    keys = request_keys(seed, first_prompt, len(examples), num_samples)
    decoder = self.decoder(sp)
    for ep in self.episodes(examples, keys, num_samples):
      decoder.submit(ep)
    t0 = time.perf_counter()
    done: list[Episode] = []
    try:
      while decoder.busy:
        done += decoder.advance()
    finally:
      decoder.close()
    total = time.perf_counter() - t0
    share = decoder.env_seconds / max(total, 1e-9)
    return self.collect(done, sp, env_time_share=share)

  def demonstrations(self, examples: Sequence[Example]) -> list[Demonstration]:
    """The environment expert's trajectories on `examples` (the SFT
    warm-up's rows; jaxcorr/agents/demonstrations.py). One that fails is
    an empty row (no loss); `EnvironmentFailing` when more than
    `max_env_error_fraction` of them do."""
    end = turn_end_id(self.turns, self.tokenizer, self.stop_ids)
    out, errors = [], []
    for ex in examples:
      try:
        demo = demonstrate(
          self.spec,
          self.runner.session(self.tokenizer),
          self.turns,
          self.tokenizer,
          end,
          ex,
          max_turns=self.cfg.max_turns,
        )
      except Exception as err:  # the environment's or expert's failure
        errors.append(describe('demonstration', err))
        demo = Demonstration([], [], [], turns=0)
      self._check_prompt(demo.prompt, ex)
      out.append(demo)
    check_bound(
      self.cfg.environment,
      errors,
      len(out),
      self.cfg.max_env_error_fraction,
      'demonstrations',
    )
    return out

  def _check_prompt(self, ids: Sequence[int], ex: Example) -> None:
    if len(ids) > self.prompt_length:
      raise ValueError(
        f'an agent prompt has {len(ids)} tokens > '
        f'config.rollout.max_prompt_length={self.prompt_length}: '
        f'{ex.prompt[:80]!r}'
      )

  def close(self) -> None:
    self.runner.close()


def _finish(episode: Episode) -> None:
  finish = getattr(episode.env, 'finish', None)
  if finish is None:
    return
  try:
    finish(episode.trajectory)
  except Exception:  # bookkeeping after the trajectory: never the run's
    logging.warning('finish of trajectory %d failed', episode.trajectory.row)
    logging.debug('finish', exc_info=True)


def trajectory_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
  """Means over the trajectories, and the counts of `SUM_METRICS`."""

  def info(key):
    return [t.info.get(key, 0.0) for t in trajectories]

  agent = [sum(t.agent) for t in trajectories]
  env = [len(t.tokens) - a for t, a in zip(trajectories, agent)]
  calls = [sum(t.tool_outcomes.values()) for t in trajectories]
  outcomes = {
    f'agent/tool_{o}': float(sum(t.tool_outcomes[o] for t in trajectories))
    for o in OUTCOMES
  }
  return {
    'agent/turns_mean': float(np.mean([t.turns for t in trajectories])),
    'agent/truncated_fraction': float(
      np.mean([t.truncated for t in trajectories])
    ),
    'agent/tool_call_rate': float(np.mean([c > 0 for c in calls])),
    'agent/agent_tokens_mean': float(np.mean(agent)),
    'agent/env_tokens_mean': float(np.mean(env)),
    'agent/turn_reward_mean': float(np.mean([t.reward for t in trajectories])),
    'agent/tool_calls': float(sum(calls)),
    **outcomes,
    'agent/malformed_calls': float(np.sum(info('malformed_calls'))),
    'agent/env_errors': float(np.sum(info('env_errors'))),
    'agent/long_observations': float(np.sum(info('long_observations'))),
  }
