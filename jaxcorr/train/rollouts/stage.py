"""Prompts -> scored rollouts: the part of a step shared by the sync loop,
the async producer and evaluation, and the one place the trainer builds and
calls the rollout engine (`make_engine`, `driver.generate`).

    examples --encode--> prompt ids --driver.generate (JetStream engine)-->
    RolloutBatch --decode responses--> reward functions --> Scored

The engine's token ids are what the trainer trains on; responses are
decoded only for the reward functions (docs/math/rollout_contract.md §3). The
sampling seed of step s is fold_in(PRNGKey(train.seed), s): a step's rollouts do
not depend on what ran before it, which is what makes resume exact.

Multi-host: every process samples its own contiguous share of the global
batch (`data.PromptLoader`, the held-out split), all shares of one size, so
process i's first prompt is prompt i * len(examples) of the batch. That
global index, not the local one, keys the sampling (`driver.generate`'s
`first_prompt`): a sample's tokens are the same whatever the number of
processes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcorr.agents import episodes
from jaxcorr.data import prompts as data
from jaxcorr.data import task_ids, text
from jaxcorr.data.tasks import Example
from jaxcorr.rewards import RewardScorer
from jaxcorr.rollout import RolloutBatch, driver
from jaxcorr.rollout.engine import PolicyEngine
from jaxcorr.rollout.state import SamplingParams
from jaxcorr.train.rollouts import draft
from jaxcorr.train.rollouts.weights import quant_spec
from jaxcorr.train.run_config import RunConfig
from jaxcorr.train.tracker.reduction import Metric, Metrics


@dataclasses.dataclass
class Scored:
  """One step's rollouts with their rewards.

  Attributes:
    step: the RL step it was sampled for.
    batch: the host `RolloutBatch`.
    rewards: `[B]` float32 sequence rewards.
    metrics: reward-function metrics and `time/rollout`, `time/reward`,
      each with how it combines across processes.
    loader_state: the prompt loader's state after drawing this batch (what
      a checkpoint taken after training on it must record).
    version: the policy version that sampled it.
  """

  step: int
  batch: RolloutBatch
  rewards: np.ndarray
  metrics: Metrics
  loader_state: dict | None = None
  version: int = 0
  # [F, B] each reward function's value per row (`RewardScorer.score_each`).
  scores: np.ndarray | None = None


# RewardScorer's counts over the rows; its other metrics are means.
_REWARD_COUNTS = ('reward/failures', 'reward/timeouts')


def engine_length(run: RunConfig) -> int:
  """The engine's cache length: prompt + response (+ the agents'
  headroom); exact mode's attention extent in the trainer too."""
  r = run.rollout
  return (
    r.max_prompt_length + r.max_new_tokens + episodes.engine_headroom(run.agent)
  )


def make_engine(run: RunConfig, policy: Any, mesh: Any) -> PolicyEngine:
  """The rollout engine for `policy` (a module) on `mesh`."""
  r = run.rollout
  return PolicyEngine(
    policy,
    max_concurrent_decodes=r.max_concurrent_decodes,
    decode_chunk=r.decode_chunk,
    max_prefill_length=episodes.engine_prefill(
      run.agent, r.max_prompt_length, r.max_new_tokens
    ),
    max_target_length=engine_length(run),
    mesh=mesh,
    dtype=jnp.dtype(r.engine_dtype),
    # A set can never be wider than the vocabulary.
    kept_set_capacity=(
      min(r.kept_set_capacity, policy.config.vocab_size)
      if r.logprob_mode == 'replay'
      else 0
    ),
    lora=run.lora,
    quantization=quant_spec(r),
    kv_cache_dtype=r.kv_cache_dtype,
    exact=r.exact,
    speculative=run.speculative,
    draft=draft.for_run(run, mesh),
  )


# The agent metrics a greedy evaluation reports (as eval/<name>).
_EVAL_AGENT_METRICS = (
  'agent/tool_call_rate',
  'agent/turns_mean',
  'agent/malformed_calls',
  'agent/truncated_fraction',
)


def step_seed(seed: int, step: int) -> int:
  """A per-step sampling seed, independent of the steps before it."""
  return int(np.random.SeedSequence([seed, step]).generate_state(1)[0] >> 1)


class RolloutStage:
  """Generation and scoring over one `PolicyEngine`."""

  def __init__(
    self,
    run: RunConfig,
    engine: PolicyEngine,
    tokenizer: Any,
    scorer: RewardScorer,
  ):
    self.run = run
    self.engine = engine
    self.tokenizer = tokenizer
    self.scorer = scorer
    self.stop_ids = text.stop_ids(tokenizer)
    self.tasks = task_ids.task_names(run.data)  # the batch's task_id table
    self.agents = None  # multi-turn rollouts (config.agent), else None
    if run.agent.enabled:
      self.agents = episodes.AgentRollouts(
        run.agent,
        engine,
        tokenizer,
        episodes.turn_template(run.agent, run.model.hf_path),
        self.stop_ids,
        prompt_length=run.rollout.max_prompt_length,
        response_length=run.rollout.max_new_tokens,
      )

  def encode(self, examples: Sequence[Example]) -> list[list[int]]:
    """Prompt ids; a prompt longer than `rollout.max_prompt_length` fails."""
    limit = self.run.rollout.max_prompt_length
    out = []
    for ex in examples:
      ids = self.tokenizer.encode(
        data.format_prompt(self.run.data.prompt_template, ex)
      )
      if len(ids) > limit:
        raise ValueError(
          f'a prompt has {len(ids)} tokens > config.rollout.max_prompt_length'
          f'={limit}: {ex.prompt[:80]!r}; raise the limit or filter the data'
        )
      out.append(ids)
    return out

  def responses(self, batch: RolloutBatch) -> list[str]:
    tokens = np.asarray(batch.response_tokens)
    lengths = np.asarray(batch.context_mask).sum(1)
    return [
      self.tokenizer.decode(t[:n].tolist()) for t, n in zip(tokens, lengths)
    ]

  def run_step(
    self,
    examples: Sequence[Example],
    *,
    step: int,
    greedy: bool = False,
    first_prompt: int | None = None,
  ) -> Scored:
    """Sample (or decode greedily, one sample) and score `examples`.

    `first_prompt` is the index of `examples[0]` in the global batch
    (default: this process's equal share, module docstring).
    """
    r = self.run.rollout
    return self.sample(
      examples,
      step=step,
      num_samples=1 if greedy else r.samples_per_prompt,
      temperature=r.temperature,
      top_k=1 if greedy else r.top_k,
      top_p=1.0 if greedy else r.top_p,
      min_p=0.0 if greedy else r.min_p,
      first_prompt=first_prompt,
    )

  def sample(
    self,
    examples: Sequence[Example],
    *,
    step: int,
    num_samples: int,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    first_prompt: int | None = None,
  ) -> Scored:
    """`run_step` at explicit sampling settings (`jaxcorr.sampling`); the
    sampled eval pass uses its preset's."""
    if first_prompt is None:
      first_prompt = jax.process_index() * len(examples)
    t0 = time.perf_counter()
    if self.agents is not None:
      sp = SamplingParams(temperature, top_k, top_p, min_p)
      return self._run_agents(examples, step, sp, first_prompt, num_samples, t0)
    batch = driver.generate(
      self.engine,
      self.encode(examples),
      num_samples=num_samples,
      max_new_tokens=self.run.rollout.max_new_tokens,
      temperature=temperature,
      top_k=top_k,
      top_p=top_p,
      min_p=min_p,
      stop_token_ids=self.stop_ids,
      seed=step_seed(self.run.train.seed, step),
      first_prompt=first_prompt,
    )
    return self.score(
      examples, batch, step=step, rollout_s=time.perf_counter() - t0
    )

  def _run_agents(self, examples, step, sp, first_prompt, n, t0):
    """`sample` with multi-turn trajectories (`config.agent`)."""
    out = self.agents.sample(
      examples,
      num_samples=n,
      sp=sp,
      seed=step_seed(self.run.train.seed, step),
      first_prompt=first_prompt,
    )
    return self.score_agents(
      examples, out, step=step, rollout_s=time.perf_counter() - t0
    )

  def score_agents(
    self,
    examples: Sequence[Example],
    out: episodes.AgentBatch,
    *,
    step: int,
    rollout_s: float,
  ) -> Scored:
    """`score` of finished trajectories (every rollout mode): the reward
    functions score each trajectory's final answer, plus its turn rewards;
    the agent metrics join the reward metrics."""
    scored = self.score(
      examples, out.batch, step=step, rollout_s=rollout_s, responses=out.finals
    )
    scored.rewards = scored.rewards + out.turn_rewards
    for k, v in out.metrics.items():
      sums = episodes.SUM_METRICS
      scored.metrics[k] = Metric.sum(v) if k in sums else Metric.avg(v)
    return scored

  def score(
    self,
    examples: Sequence[Example],
    batch: RolloutBatch,
    *,
    step: int,
    rollout_s: float,
    responses: Sequence[str] | None = None,
  ) -> Scored:
    """Rewards for a batch sampled from `examples` (its rows in order, the
    samples of a prompt adjacent); `rollout_s`: the sampling time;
    `responses`: the texts to score (default: the decoded responses)."""
    t1 = time.perf_counter()
    n = batch.batch_size // len(examples)
    answers = [ex.answer for ex in examples for _ in range(n)]
    if responses is None:
      responses = self.responses(batch)
    rewards, scores, values = self.scorer.score_each(list(responses), answers)
    metrics = {
      k: Metric.sum(v) if k in _REWARD_COUNTS else Metric.avg(v)
      for k, v in scores.items()
    }
    metrics['time/rollout'] = Metric.avg(rollout_s)
    metrics['time/reward'] = Metric.avg(time.perf_counter() - t1)
    mask = np.asarray(batch.response_mask, bool)
    version = np.asarray(batch.policy_version)[mask]
    ids = task_ids.task_ids(examples, self.tasks, self.run.data.source, n)
    batch = batch.replace(task_id=ids)
    return Scored(
      step=step,
      batch=batch,
      rewards=np.asarray(rewards, np.float32),
      metrics=metrics,
      # The newest weights that sampled any of its tokens.
      version=int(version.max())
      if version.size
      else self.engine.policy_version,
      scores=values,
    )

  def evaluate(self, examples: Sequence[Example], *, step: int) -> Metrics:
    """Greedy decoding on held-out prompts: `eval/reward_mean` and
    `eval/accuracy` (the mean of the first reward function)."""
    if not examples:
      return {}
    return self.eval_metrics(self.run_step(examples, step=step, greedy=True))

  def eval_metrics(self, scored: Scored) -> Metrics:
    """`evaluate`'s metrics of a greedy batch."""
    primary = scored.metrics[f'reward/{self.scorer.names[0]}/mean']
    lengths = np.asarray(scored.batch.response_mask).sum(1)
    out = {
      'eval/reward_mean': Metric.avg(float(np.mean(scored.rewards))),
      'eval/accuracy': Metric.avg(float(primary.value)),
      'eval/response_length': Metric.avg(float(lengths.mean())),
      'time/eval': scored.metrics['time/rollout'],
    }
    # With agents: how the greedy policy uses its tools.
    for k in _EVAL_AGENT_METRICS:
      if k in scored.metrics:
        out[k.replace('agent/', 'eval/')] = scored.metrics[k]
    return out
