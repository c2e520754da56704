"""The multi-turn driver on a tiny model with a ChatML template over a
tokenizer with special tokens:

* continuing a trajectory on its slot's KV cache samples what re-prefilling
  the whole history samples (same tokens, same log-probs);
* environment tokens carry no loss, no μ and no version, and are exactly
  the template's delta;
* the engine's agent-token log-probs equal the trainer's forward on the
  same ids (no re-tokenization drift);
* a weight swap between rounds leaves each token its own version, and a
  per-token staleness mask acts on agent tokens only; with recomputed
  caches each agent token's μ is its own version's log-prob;
* an over-long trajectory is truncated and flagged (and, optionally,
  dropped from the loss).
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from jaxcorr.agents.driver import AgentDecoder, Episode, TurnLimits
from jaxcorr.agents.environment import StepResult
from jaxcorr.agents.trajectory import Trajectory, to_batch
from jaxcorr.data.tasks import Example
from jaxcorr.model import token_logprobs
from jaxcorr.rollout import FinishReason
from jaxcorr.rollout.driver import request_keys
from jaxcorr.rollout.state import SamplingParams
from jaxcorr.train import batch as batch_lib
from jaxcorr.train.scoring import at_response
from tests.agents.engine_setup import P, T
from tests.helpers.model_testing import random_model

SP = SamplingParams(temperature=1.0)
TOOL = {'role': 'tool', 'content': '408'}


class ScriptedEnv:
  """Answers two turns with a tool message (reward 0.5 each), then ends:
  every trajectory has three agent turns whatever the model writes."""

  def __init__(self):
    self.turn = 0

  def reset(self, row):
    return [{'role': 'user', 'content': row.prompt}]

  def step(self, action):
    self.turn += 1
    if self.turn >= 3:
      return StepResult([], done=True)
    return StepResult([TOOL], reward=0.5, info={'tool_calls': 1})


def _run(
  setup,
  *,
  reuse=True,
  limits=None,
  swap_after=None,
  swap_params=None,
  recompute=False,
  rows=2,
  n=2,
):
  tok, _, engine, turns, continuation = setup
  engine.update_params(engine.params, version=0)
  decoder = AgentDecoder(
    engine,
    turns,
    tok.decode,
    sp=SP,
    limits=limits or TurnLimits(turn_tokens=8, max_turns=4, response_length=T),
    stop_token_ids=tok.stop_ids,
    continuation=continuation if reuse else None,
  )
  keys = request_keys(0, 0, rows, n)
  examples = [Example('What is 12*34?', '408'), Example('And 7*8?', '56')]
  for i in range(rows):
    for s in range(n):
      env = ScriptedEnv()
      prompt = turns.prompt_ids(env.reset(examples[i]))
      tr = Trajectory(row=i * n + s, group=i, sample=s, prompt=prompt)
      decoder.submit(Episode(tr, env, keys[i * n + s]))
  done, rounds = [], 0
  while decoder.busy:
    done += decoder.advance()
    rounds += 1
    if rounds == swap_after:
      params = engine.params if swap_params is None else swap_params
      decoder.swap(params, version=1, recompute=recompute)
  decoder.close()
  return sorted((e.trajectory for e in done), key=lambda t: t.row)


@pytest.fixture(scope='module')
def reused(setup):
  return _run(setup)


@pytest.mark.slow  # compiles the re-prefill path's prefill buckets
def test_continuation_equals_re_prefill(setup, reused):
  again = _run(setup, reuse=False)
  assert [t.tokens for t in reused] == [t.tokens for t in again]
  assert [t.agent for t in reused] == [t.agent for t in again]
  for a, b in zip(reused, again):
    np.testing.assert_allclose(a.logp, b.logp, atol=2e-5)
  assert all(t.turns == 3 for t in reused)


def test_env_tokens_are_the_delta_and_carry_nothing(setup, reused):
  tok, _, _, turns, _ = setup
  batch = to_batch(reused, prompt_length=P, response_length=T, sp=SP)
  agent = np.asarray(batch.response_mask)
  env = np.asarray(batch.context_mask) & ~agent
  assert env.any() and agent.any()
  assert (np.asarray(batch.rollout_logp)[env] == 0).all()
  assert (np.asarray(batch.policy_version)[env] == -1).all()
  assert (np.asarray(batch.policy_version)[agent] == 0).all()
  tr = reused[0]
  first_turn = tr.agent.index(False)
  stopped = tr.tokens[first_turn - 1] == tok.eos_id
  delta = turns.env_ids([TOOL], tok.eos_id if stopped else None)
  assert tr.tokens[first_turn : first_turn + len(delta)] == delta
  # The trainer's batch: environment tokens are context, never loss or μ.
  train = batch_lib.assemble(
    batch,
    np.zeros(batch.batch_size, np.float32),
    trainer_version=0,
    max_staleness=None,
    logprob_mode='full',
    row_multiple=1,
  )
  assert (train.response_mask == agent).all()
  assert (train.rollout_logp[env] == 0).all()


def _train_batch(trajectories):
  batch = to_batch(trajectories, prompt_length=P, response_length=T, sp=SP)
  train = batch_lib.assemble(
    batch,
    np.zeros(batch.batch_size, np.float32),
    trainer_version=0,
    max_staleness=None,
    logprob_mode='full',
    row_multiple=1,
  )
  return batch, train


def _trainer_logp(model, train):
  """The trainer's log-probs of `train`'s response tokens under `model`
  (every model of the setup's config shares one compilation)."""
  graphdef, params = nnx.split(model)
  logp = _forward(graphdef, params, train.tokens, train.temperature,
                  train.segment_ids)  # fmt: skip
  return np.asarray(at_response(logp, train))


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, params, tokens, temperature, segment_ids):
  return token_logprobs(
    nnx.merge(graphdef, params),
    tokens,
    temperature=temperature,
    segment_ids=segment_ids,
  )


def test_engine_logp_equals_trainer_forward(setup, reused):
  _, model, _, _, _ = setup
  _, train = _train_batch(reused)
  mask = train.response_mask
  np.testing.assert_allclose(
    _trainer_logp(model, train)[mask], train.rollout_logp[mask], atol=2e-5
  )


def test_recomputed_caches_give_each_token_its_versions_logp(setup):
  """`swap(recompute=True)`: the live slots' caches (prompt, agent and
  environment tokens, decoding or waiting to continue) are recomputed
  under the new weights, so every agent token's μ is the log-prob of the
  version that sampled it. Version 1 is another random model: a kept
  (stale) cache would be far off."""
  _, model, engine, _, _ = setup
  moved = random_model(model.config, seed=1)
  try:
    trajectories = _run(
      setup, swap_after=1, swap_params=nnx.state(moved), recompute=True
    )
  finally:
    engine.update_params(nnx.state(model), version=0)
  batch, train = _train_batch(trajectories)
  version = np.asarray(batch.policy_version)
  mask = train.response_mask
  assert set(version[mask].tolist()) == {0, 1}
  for v, weights in ((0, model), (1, moved)):
    own = mask & (version == v)
    np.testing.assert_allclose(
      _trainer_logp(weights, train)[own], train.rollout_logp[own], atol=2e-5
    )


def test_weight_swap_keeps_per_token_versions(setup):
  trajectories = _run(setup, swap_after=1)
  batch = to_batch(trajectories, prompt_length=P, response_length=T, sp=SP)
  version = np.asarray(batch.policy_version)
  agent = np.asarray(batch.response_mask)
  env = np.asarray(batch.context_mask) & ~agent
  assert (version[env] == -1).all()
  spans = [set(version[i][agent[i]].tolist()) for i in range(len(version))]
  assert all(s <= {0, 1} for s in spans)
  assert any(s == {0, 1} for s in spans)
  # Staleness acts per token: with a bound of 0 at trainer version 1, the
  # version-0 agent tokens leave the mask, the version-1 ones stay.
  kept = batch_lib.keep_tokens(batch, 1, 0, 'mask')
  assert (kept == (agent & (version == 1))).all()


def test_over_long_trajectories_are_truncated_and_flagged(setup):
  limits = TurnLimits(turn_tokens=8, max_turns=4, response_length=24)
  short = _run(setup, limits=limits)
  assert all(len(t.tokens) <= 24 for t in short)
  assert all(t.truncated and t.finish == FinishReason.LENGTH for t in short)
  kept = to_batch(short, prompt_length=P, response_length=24, sp=SP)
  dropped = to_batch(
    short, prompt_length=P, response_length=24, sp=SP, drop_truncated=True
  )
  assert np.asarray(kept.response_mask).any()
  assert not np.asarray(dropped.response_mask).any()
  assert (dropped.context_mask == kept.context_mask).all()
  turns = _run(
    setup, limits=dataclasses.replace(limits, max_turns=2, response_length=T)
  )
  assert all(t.turns == 2 and t.truncated for t in turns)
