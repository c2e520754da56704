"""Multi-turn tool-use rollouts: what keeping each trajectory's KV cache
across turns buys, what the environments cost, what the agent mask costs.

  python bench/agents.py                 # ~5 minutes on a 2-core CPU
  python bench/agents.py --turns=4 --repeats=3

1. **Prefix-KV reuse vs re-prefill** (same engine, same run): B
   trajectories of `--turns` agent turns (`--turn_tokens` each; a random
   model rarely stops early) with a fixed-length tool observation between
   turns, on the arithmetic character vocabulary with a long system-style
   prompt (tool schemas make real prompts long). `AgentDecoder` with a
   `Continuation` (env tokens prefilled onto the slot) against the same
   decoder re-prefilling the whole history each turn. Both draw the same
   tokens (tests/agents/test_driver.py); reported: agent tokens/s of
   each (after a compile pass), and their ratio.
2. **Environment share**: the calculator task (configs/arith_tool.py:pulse)
   trained for a few steps by the trainer: `agent/env_time_share` (the
   share of rollout time in environment steps and tool calls) and the
   rollout's share of the step.
3. **Agent-mask cost in the update**: the same scored multi-turn batch
   trained on twice from the same state, once with the agent mask and once
   with every context token in the mask (the single-turn layout);
   `time/update` medians. The mask is data in one compiled program, so
   the difference is noise.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import arith_tool
from jaxcorr.agents.continuation import Continuation, cache_headroom
from jaxcorr.agents.driver import AgentDecoder, Episode, TurnLimits
from jaxcorr.agents.environment import StepResult
from jaxcorr.agents.trajectory import Trajectory
from jaxcorr.agents.turns import ARITH_TOOL_TEMPLATE, TurnFormat
from jaxcorr.data.chat import ChatTemplate
from jaxcorr.data.tasks import CharTokenizer
from jaxcorr.model import Transformer, TransformerConfig
from jaxcorr.rollout.driver import request_keys
from jaxcorr.rollout.engine import PolicyEngine
from jaxcorr.rollout.state import SamplingParams
from jaxcorr.train.loop import Trainer


class FixedEnv:
  """A tool message of `length` digits after every turn; done after
  `turns` agent turns."""

  def __init__(self, turns: int, length: int):
    self.turns, self.length, self.seen = turns, length, 0

  def reset(self, row):
    return [{'role': 'user', 'content': row}]

  def step(self, action):
    self.seen += 1
    if self.seen >= self.turns:
      return StepResult([], done=True)
    digits = ('1234567890' * (self.length // 10 + 1))[: self.length]
    return StepResult([{'role': 'tool', 'content': digits}])


def rollout_speed(args) -> dict:
  tok = CharTokenizer()
  cfg = TransformerConfig(
    vocab_size=tok.vocab_size,
    hidden_size=args.hidden,
    intermediate_size=3 * args.hidden,
    num_layers=args.layers,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=4096,
  )
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  turns = TurnFormat(ChatTemplate(ARITH_TOOL_TEMPLATE), tok)
  prompt_text = ('12*34=' * (args.prompt_chars // 6 + 1))[: args.prompt_chars]
  prompt = turns.prompt_ids([{'role': 'user', 'content': prompt_text}])
  env_len = len(turns.env_ids([{'role': 'tool', 'content': '1' * args.obs}], 2))
  resp = args.turns * (args.turn_tokens + env_len)
  p = len(prompt)
  engine = PolicyEngine(
    model,
    max_concurrent_decodes=args.slots,
    max_prefill_length=p + resp,
    max_target_length=p + resp + cache_headroom(env_len + 1),
    decode_chunk=16,
  )
  limits = TurnLimits(args.turn_tokens, args.turns, resp, env_len + 1)
  sp = SamplingParams(1.0)
  cont = Continuation(engine)

  def run(reuse: bool, seed: int) -> tuple[float, int]:
    decoder = AgentDecoder(
      engine, turns, tok.decode, sp=sp, limits=limits,
      stop_token_ids=(), continuation=cont if reuse else None,
    )  # fmt: skip
    keys = request_keys(seed, 0, args.trajectories, 1)
    for i in range(args.trajectories):
      tr = Trajectory(row=i, group=i, sample=0, prompt=prompt)
      decoder.submit(Episode(tr, FixedEnv(args.turns, args.obs), keys[i]))
    t0 = time.perf_counter()
    done = []
    while decoder.busy:
      done += decoder.advance()
    jax.block_until_ready(decoder.state)
    dt = time.perf_counter() - t0
    decoder.close()
    agent = sum(sum(e.trajectory.agent) for e in done)
    return dt, agent

  out = {}
  for reuse in (True, False):
    run(reuse, seed=100)  # compile every shape this mode dispatches
  for reuse in (True, False):
    times = []
    for r in range(args.repeats):
      dt, agent = run(reuse, seed=r)
      times.append(dt)
    name = 'kv_reuse' if reuse else 're_prefill'
    out[name] = {'s': statistics.median(times), 'agent_tokens': agent}
    out[name]['tokens_per_s'] = agent / out[name]['s']
  out['speedup'] = (
    out['kv_reuse']['tokens_per_s'] / (out['re_prefill']['tokens_per_s'])
  )
  out['prompt_tokens'], out['env_tokens_per_turn'] = p, env_len
  return out


def trainer_costs(args) -> dict:
  c = arith_tool.get_config('pulse')
  c.train.num_steps = args.train_steps
  c.train.eval_every = 0
  c.train.checkpoint_every = 0
  c.train.loggers = 'jsonl'
  with tempfile.TemporaryDirectory() as workdir:
    trainer = Trainer.from_config(c, workdir, config_name='bench')
    share, rollout_share = [], []
    engine = trainer.stage.engine
    for s in range(args.train_steps):
      t0 = time.perf_counter()
      engine.update_params(trainer.engine_params(), version=s)
      scored = trainer.stage.run_step(trainer.loader.next_batch(), step=s)
      out = trainer.train_on(scored)
      trainer.step += 1
      step_s = time.perf_counter() - t0
      if s:  # the first step compiles
        share.append(scored.metrics['agent/env_time_share'].value)
        rollout_share.append(scored.metrics['time/rollout'].value / step_s)
    # The agent mask's cost: one batch, two masks, the same state.
    state = jax.tree.map(jnp.copy, trainer.state)
    masked, full = [], []
    for _ in range(args.repeats + 1):
      for which, times in (('agent', masked), ('full', full)):
        sc = copy.copy(scored)
        if which == 'full':
          b = sc.batch
          sc.batch = b.replace(
            response_mask=np.asarray(b.context_mask),
            rollout_logp=np.where(b.context_mask, -1.0, 0.0).astype(np.float32),
            policy_version=np.where(b.context_mask, trainer.step, -1).astype(
              np.int32
            ),
          )
        trainer.state = jax.tree.map(jnp.copy, state)  # the update donates
        out = trainer.train_on(sc)
        times.append(out['time/update'])
    trainer.close()
  return {
    'env_time_share_of_rollout': statistics.median(share),
    'rollout_share_of_step': statistics.median(rollout_share),
    'update_s_agent_mask': statistics.median(masked[1:]),
    'update_s_full_mask': statistics.median(full[1:]),
    'update_ratio_agent_over_full': statistics.median(
      a / b for a, b in zip(masked[1:], full[1:])
    ),
  }


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument('--turns', type=int, default=4)
  ap.add_argument('--turn_tokens', type=int, default=32)
  ap.add_argument('--obs', type=int, default=16, help='tool result digits')
  ap.add_argument('--prompt_chars', type=int, default=192)
  ap.add_argument('--trajectories', type=int, default=32)
  ap.add_argument('--slots', type=int, default=16)
  ap.add_argument('--hidden', type=int, default=128)
  ap.add_argument('--layers', type=int, default=4)
  ap.add_argument('--repeats', type=int, default=3)
  ap.add_argument('--train_steps', type=int, default=4)
  ap.add_argument('--skip_trainer', action='store_true')
  ap.add_argument('--skip_rollout', action='store_true')
  args = ap.parse_args()
  print('device:', jax.devices()[0].device_kind, '| args:', vars(args))
  if not args.skip_rollout:
    for k, v in rollout_speed(args).items():
      print(f'{k}: {v}')
  if not args.skip_trainer:
    for k, v in trainer_costs(args).items():
      print(f'{k}: {v:.4f}')


if __name__ == '__main__':
  main()
