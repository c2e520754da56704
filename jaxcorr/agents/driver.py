"""Multi-turn rollouts: continuous batching over trajectories at different
turns, each keeping its slot (and KV cache) from its first turn to its last.

    submit(episode)    a trajectory waits for a free slot
    advance()          one round:
                         continue the slots whose environment answered
                         (`Continuation`: its tokens prefilled onto the
                         slot's cache, the next turn's first token drawn),
                         admit waiting trajectories into free slots (one
                         prefill per prompt), decode one chunk of every
                         live slot, read it back once;
                         then, for every agent turn that ended in the
                         chunk, step its environment (on worker threads,
                         in parallel): an answer or a budget ends the
                         trajectory and frees its slot, anything else
                         queues the observation's tokens for the next round
    swap(params, v)    new weights between rounds: later tokens record v
                       (live caches kept, or recomputed under them)

Without a `Continuation` a continuing trajectory is re-prefilled from its
whole history instead (prompt, every turn so far, the new tokens): the
baseline bench/agents.py compares against, and what tests/agents check the
continuation against (same tokens, same log-probs).

Per-token records: each agent token keeps the log-probs it was sampled
with and the version of the weights of its dispatch, so a trajectory
whose turns straddle a weight swap holds tokens of several versions
(staleness policies then act per token, jaxcorr/train/rollouts/staleness.py).
Turn t of an episode samples with fold_in(episode_key, t), whichever slot,
round or neighbours it gets.

An environment that fails (raises, or returns an unusable `StepResult`:
jaxcorr/agents/failures.py) ends its trajectory as an ABORT row with the
failure in `Trajectory.error`; an episode submitted already failed (its
`reset` raised) comes back from the next round untouched.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from jaxcorr.agents.continuation import Continuation
from jaxcorr.agents.environment import Environment, StepResult
from jaxcorr.agents.failures import check_result, describe
from jaxcorr.agents.trajectory import Trajectory
from jaxcorr.agents.turns import TurnFormat
from jaxcorr.rollout import FinishReason
from jaxcorr.rollout.engine import PolicyEngine
from jaxcorr.rollout.state import SamplingParams


@dataclasses.dataclass
class Episode:
  """A trajectory in flight: its record, environment and sampling key."""

  trajectory: Trajectory
  env: Environment | None  # None: failed before its first turn
  key: np.ndarray  # uint32 [2]
  turn: list[int] = dataclasses.field(default_factory=list)  # this turn's ids
  pending: list[int] | None = None  # environment ids to continue with
  tag: Any = None  # the caller's mark (the stream's draw)


@dataclasses.dataclass(frozen=True)
class TurnLimits:
  """The budgets of a trajectory.

  Attributes:
    turn_tokens: most tokens of one agent turn.
    max_turns: most agent turns.
    response_length: most tokens after the prompt (agent and environment).
    env_tokens: most tokens of one environment turn.
  """

  turn_tokens: int
  max_turns: int
  response_length: int
  env_tokens: int = 64


class AgentDecoder:
  """Episodes in, finished episodes out (module docstring).

  Args:
    engine: the engine; the decoder owns its decode state.
    turns: the chat template's prompt and delta ids.
    decode: ids -> text (the agent turn the environment reads).
    sp: sampling parameters.
    limits: the trajectory budgets.
    stop_token_ids: tokens that end an agent turn.
    continuation: continues slots on their caches (one per engine: it
      holds the compiled program); None re-prefills the history.
    env_workers: threads that step environments.
  """

  def __init__(
    self,
    engine: PolicyEngine,
    turns: TurnFormat,
    decode: Callable[[Sequence[int]], str],
    *,
    sp: SamplingParams,
    limits: TurnLimits,
    stop_token_ids: Sequence[int],
    continuation: Continuation | None = None,
    env_workers: int = 4,
  ):
    self.engine, self.turns, self.decode = engine, turns, decode
    self.sp, self.limits = sp, limits
    self.continuation = continuation
    self.stop = frozenset(int(t) for t in stop_token_ids)
    self.stop_arr = engine.stop_array(self.stop)
    self.vocab_size = engine.config.real_vocab_size or engine.config.vocab_size
    self.waiting: collections.deque[Episode] = collections.deque()
    self.failed: list[Episode] = []  # submitted failed: out next round
    self.slots: list[Episode | None] = [None] * engine.max_concurrent_decodes
    self.state = engine.init_decode_state()
    self._pool = concurrent.futures.ThreadPoolExecutor(env_workers)
    self.env_seconds = 0.0  # wall time of environment steps

  @property
  def busy(self) -> bool:
    busy = self.waiting or self.failed
    return bool(busy) or any(e is not None for e in self.slots)

  def submit(self, episode: Episode) -> None:
    if episode.trajectory.error:
      self.failed.append(episode)
    else:
      self.waiting.append(episode)

  def swap(self, params: Any, version: int, *, recompute: bool = False) -> None:
    """Weights of policy `version` from the next round on. Live slots keep
    their caches (the tokens they hold keep their versions), or with
    `recompute` get them recomputed under the new weights: a slot's cache
    holds its prompt and every token but the newest, whether it is
    decoding or waiting to continue (the continuation writes from the
    newest token on)."""
    self.engine.update_params(params, version=version)
    if recompute and any(e is not None for e in self.slots):
      contexts = [
        None if e is None else [*e.trajectory.prompt, *e.trajectory.tokens[:-1]]
        for e in self.slots
      ]
      self.state = self.engine.refresh_cache(self.state, contexts)

  def close(self) -> None:
    self._pool.shutdown(wait=False)

  # ------------------------------------------------------------ a round

  def advance(self) -> list[Episode]:
    """One round (module docstring); the episodes that finished in it."""
    engine = self.engine
    version = engine.policy_version
    done, self.failed = self.failed, []
    firsts = [self._continue(), self._admit()]
    firsts = [f for f in firsts if f is not None]
    live = [i for i, e in enumerate(self.slots) if e is not None]
    if not live:
      return done
    n = len(live)
    self.state, out = engine.decode_chunk(
      self.state,
      self.stop_arr,
      exit_active=n - max(1, n // 8) if n > 1 else 0,
      attend_len=engine.layout.attend_bucket(self._reach()),
    )
    out, firsts = jax.device_get((out, firsts))  # the one sync per round
    for episodes, (tok, lp, lpt) in firsts:
      for m, ep in enumerate(episodes):
        ep.trajectory.add_agent(
          tok[m : m + 1], lp[m : m + 1], lpt[m : m + 1], version
        )
        ep.turn = [int(tok[m])]
    ended = []
    for slot in live:
      ep = self.slots[slot]
      k = out.counts[slot]
      ep.trajectory.add_agent(
        out.tokens[slot, :k], out.logp[slot, :k],
        out.logp_truncated[slot, :k], version,
      )  # fmt: skip
      ep.turn += out.tokens[slot, :k].tolist()
      if not out.active[slot]:
        ended.append(slot)
    t0 = time.perf_counter()
    finals = list(
      self._pool.map(self._after_turn, [self.slots[s] for s in ended])
    )
    self.env_seconds += time.perf_counter() - t0
    for slot, final in zip(ended, finals):
      if final:
        done.append(self.slots[slot])
        self.slots[slot] = None
    return done

  # ------------------------------------------------------------ parts

  def _turn_keys(self, episodes: Sequence[Episode]) -> np.ndarray:
    keys = np.stack([ep.key for ep in episodes])
    turns = np.asarray([ep.trajectory.turns for ep in episodes], np.uint32)
    return np.asarray(jax.vmap(jax.random.fold_in)(keys, turns))

  def _limit(self, tr: Trajectory, extra: int = 0) -> int:
    room = self.limits.response_length - len(tr.tokens) - extra
    return min(self.limits.turn_tokens, room)

  def _continue(self):
    """Continue every slot whose environment answered; (episodes, their
    first tokens on device) or None."""
    slots = [
      i
      for i, e in enumerate(self.slots)
      if e is not None and e.pending is not None
    ]
    if not slots:
      return None
    eps = [self.slots[i] for i in slots]
    keys = self._turn_keys(eps)
    limits = [self._limit(ep.trajectory, len(ep.pending)) for ep in eps]
    engine = self.engine
    if self.continuation is not None:
      self.state, first = self.continuation(
        self.state,
        slots,
        [[ep.trajectory.tokens[-1], *ep.pending] for ep in eps],
        keys,
        limits,
        self.stop_arr,
        [ep.trajectory.length - 1 for ep in eps],
      )
    else:
      history = [
        [*ep.trajectory.prompt, *ep.trajectory.tokens, *ep.pending]
        for ep in eps
      ]
      prefix = engine.prefill_batch(
        engine.params, history, list(range(len(eps))), keys, self.sp
      )
      self.state = engine.insert_batch(
        prefix, self.state, slots, limits, self.stop_arr
      )
      first = (prefix.token, prefix.logp, prefix.logp_truncated)
    for ep in eps:
      ep.trajectory.add_env(ep.pending)
      ep.pending = None
    return eps, first

  def _admit(self):
    """Prefill waiting episodes into free slots (each prompt once)."""
    free = [i for i, e in enumerate(self.slots) if e is None]
    if not free or not self.waiting:
      return None
    eps = [
      self.waiting.popleft() for _ in range(min(len(free), len(self.waiting)))
    ]
    prompts = list(
      {id(e.trajectory.prompt): e.trajectory.prompt for e in eps}.values()
    )
    where = {id(p): i for i, p in enumerate(prompts)}
    engine = self.engine
    prefix = engine.prefill_batch(
      engine.params,
      prompts,
      [where[id(e.trajectory.prompt)] for e in eps],
      self._turn_keys(eps),
      self.sp,
    )
    slots = free[: len(eps)]
    self.state = engine.insert_batch(
      prefix, self.state, slots,
      [self._limit(e.trajectory) for e in eps], self.stop_arr,
    )  # fmt: skip
    for slot, ep in zip(slots, eps):
      self.slots[slot] = ep
    return eps, (prefix.token, prefix.logp, prefix.logp_truncated)

  def _reach(self) -> int:
    chunk = self.engine.layout.chunk_steps
    reach = max(
      e.trajectory.length + chunk for e in self.slots if e is not None
    )
    return min(reach, self.engine.layout.max_target)

  def _after_turn(self, ep: Episode) -> bool:
    """Step the environment on the turn that ended; True when the
    trajectory is finished (runs on a worker thread: touches only `ep`)."""
    tr = ep.trajectory
    tr.turns += 1
    tr.turn_spans.append((len(tr.tokens) - len(ep.turn), len(tr.tokens)))
    stopped = bool(ep.turn) and ep.turn[-1] in self.stop
    text = self.decode(ep.turn)
    tr.final_text = text
    try:
      result = check_result(ep.env.step(text), self.vocab_size)
      ids = result.observation
      if not result.done and ids and isinstance(ids[0], dict):
        ids = self.turns.env_ids(ids, tr.tokens[-1] if stopped else None)
    except Exception as err:  # an environment bug ends its trajectory
      tr.fail(describe('step', err))
      # The batch's check says it in one line; the traceback at -v 1.
      logging.debug('trajectory %d: %s', tr.row, tr.error, exc_info=True)
      return True
    _record(tr, result)
    if result.done:
      tr.truncated = not stopped
      tr.finish = FinishReason.STOP if stopped else FinishReason.LENGTH
      return True
    if len(ids) > self.limits.env_tokens:
      tr.info['long_observations'] = tr.info.get('long_observations', 0) + 1
    if (
      tr.turns >= self.limits.max_turns
      or len(ids) > self.limits.env_tokens
      or self._limit(tr, len(ids)) < 1
    ):
      tr.truncated = True
      tr.finish = FinishReason.LENGTH
      return True
    ep.pending = ids
    return False


def _record(tr: Trajectory, result: StepResult) -> None:
  tr.turn_rewards.append(float(result.reward))
  for k, v in result.info.items():
    tr.info[k] = tr.info.get(k, 0) + float(v)
