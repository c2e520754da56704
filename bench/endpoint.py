"""The OpenAI-compatible endpoint's overhead (jaxcorr/endpoint) against the
in-process environment API, on the same engine and the same trajectories.

  python bench/endpoint.py                # ~3 minutes on a 2-core CPU
  python bench/endpoint.py --reps=9 --trajectories=32 --calls=128

1. **Rollouts**: B trajectories of `--turns` agent turns (`--turn_tokens`
   each) with a `--obs`-digit tool message between turns, on a tiny random
   model over bytes ('arith' chat template). Once with an in-process
   environment that returns the tool message, and once per agent kind
   with a program per trajectory that sends the same tool message through
   the endpoint (one HTTP call per agent turn): 'openai' (the official
   client) and 'http' (plain JSON over `httpx`: the server's share).
   All sample the same tokens (checked). Reported: the wall time of each
   (reset to last finish), the kinds rotated rep by rep (the shared
   machine's load drifts), the median of the endpoint / in-process ratios
   of the same rep, and the median extra time per call ((endpoint -
   in-process) / calls).
2. **Per call, no engine**: environment steps with a fixed turn text over
   conversations of `--turns` calls, in-process (a method call) and
   through the endpoint (the reply to the agent's open call, its next
   call back): median microseconds per call, kinds rotated.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
from flax import nnx

from jaxcorr.agents.continuation import Continuation, cache_headroom
from jaxcorr.agents.driver import AgentDecoder, Episode, TurnLimits
from jaxcorr.agents.environment import StepResult
from jaxcorr.agents.tool_calls import ToolCallFormat
from jaxcorr.agents.trajectory import Trajectory
from jaxcorr.agents.turns import ARITH_TOOL_TEMPLATE, TurnFormat
from jaxcorr.data.chat import ChatTemplate
from jaxcorr.data.tasks import Example
from jaxcorr.data.text import ByteTokenizer
from jaxcorr.endpoint import AgentEnvironment, EndpointServer, EndpointSettings
from jaxcorr.endpoint.environment import http_client
from jaxcorr.model import Transformer, TransformerConfig
from jaxcorr.rollout.driver import request_keys
from jaxcorr.rollout.engine import PolicyEngine
from jaxcorr.rollout.state import SamplingParams


def digits(n: int) -> str:
  return ('1234567890' * (n // 10 + 1))[:n]


class ToolTurns:
  """In process: a tool message after each turn, done after `turns`."""

  def __init__(self, turns: int, obs: int):
    self.turns, self.obs, self.seen = turns, obs, 0

  def reset(self, row):
    return [{'role': 'user', 'content': row.prompt}]

  def step(self, action):
    self.seen += 1
    if self.seen >= self.turns:
      return StepResult([], done=True)
    return StepResult([{'role': 'tool', 'content': digits(self.obs)}])


def tool_agent(turns: int, obs: int, client: str):
  """The same conversation as a program over the endpoint: with the
  official `openai` client ('openai') or plain JSON posted with `httpx`
  ('http': the server's share of the cost, without the client library's
  request building and response parsing); both over the process's one
  connection pool (`http_client`)."""

  def agent(call):
    if client == 'openai':
      oa = call.client()

      def create(messages):
        reply = oa.chat.completions.create(model=call.model, messages=messages)
        return reply.choices[0].message.content
    else:
      http = http_client()

      def create(messages):
        body = {'model': call.model, 'messages': messages}
        reply = http.post(f'{call.base_url}/chat/completions', json=body)
        return reply.json()['choices'][0]['message']['content']

    messages = [{'role': 'user', 'content': call.row.prompt}]
    for t in range(turns):
      content = create(messages)
      if t + 1 < turns:
        messages.append({'role': 'assistant', 'content': content})
        messages.append({'role': 'tool', 'content': digits(obs)})

  return agent


class Bench:
  def __init__(self, args):
    self.args = args
    self.tok = ByteTokenizer()
    cfg = TransformerConfig(
      vocab_size=self.tok.vocab_size,
      hidden_size=args.hidden,
      intermediate_size=3 * args.hidden,
      num_layers=args.layers,
      num_heads=4,
      num_kv_heads=2,
      max_position_embeddings=2048,
    )
    self.turns = TurnFormat(ChatTemplate(ARITH_TOOL_TEMPLATE), self.tok)
    self.row = Example(prompt=digits(args.prompt_chars), answer='')
    env_len = len(
      self.turns.env_ids([{'role': 'tool', 'content': digits(args.obs)}], 2)
    )
    p = len(
      self.turns.prompt_ids([{'role': 'user', 'content': self.row.prompt}])
    )
    resp = args.turns * (args.turn_tokens + env_len)
    self.engine = PolicyEngine(
      Transformer(cfg, rngs=nnx.Rngs(0)),
      max_concurrent_decodes=args.slots,
      max_prefill_length=p,
      max_target_length=p + resp + cache_headroom(env_len + 1),
      decode_chunk=16,
    )
    self.limits = TurnLimits(args.turn_tokens, args.turns, resp, env_len + 1)
    self.cont = Continuation(self.engine)
    self.server = EndpointServer()
    self.settings = EndpointSettings(agent_timeout_s=120.0)

  def env(self, kind: str, turns: int):
    if kind != 'in_process':
      agent = tool_agent(turns, self.args.obs, kind)
      return AgentEnvironment(
        self.server, agent, self.settings, ToolCallFormat(), self.tok
      )
    return ToolTurns(turns, self.args.obs)

  def rollout(self, kind: str, seed: int):
    """(wall s, calls, the trajectories' tokens)."""
    a = self.args
    t0 = time.perf_counter()
    decoder = AgentDecoder(
      self.engine, self.turns, self.tok.decode, sp=SamplingParams(1.0),
      limits=self.limits, stop_token_ids=(), continuation=self.cont,
    )  # fmt: skip
    keys = request_keys(seed, 0, a.trajectories, 1)
    for i in range(a.trajectories):
      env = self.env(kind, a.turns)
      prompt = self.turns.prompt_ids(env.reset(self.row))
      tr = Trajectory(row=i, group=i, sample=0, prompt=prompt)
      decoder.submit(Episode(tr, env, keys[i]))
    done = []
    while decoder.busy:
      done += decoder.advance()
    for e in done:
      if kind != 'in_process':
        e.env.finish(e.trajectory)
    jax.block_until_ready(decoder.state)
    decoder.close()
    dt = time.perf_counter() - t0
    done.sort(key=lambda e: e.trajectory.row)
    calls = sum(e.trajectory.turns for e in done)
    return dt, calls, [e.trajectory.tokens for e in done]

  def rollouts(self) -> dict:
    for kind in KINDS:
      self.rollout(kind, 100)  # compile every shape
    runs = {k: [] for k in KINDS}
    for r in range(self.args.reps):
      got = {k: self.rollout(k, seed=r) for k in rotate(KINDS, r)}
      for k in KINDS[1:]:
        assert got[k][2] == got[KINDS[0]][2], 'the two sampled differently'
      for k in KINDS:
        runs[k].append(got[k][:2])
    out = {'calls': runs[KINDS[0]][0][1]}
    base = [t for t, _ in runs[KINDS[0]]]
    out['in_process_s'] = statistics.median(base)
    for k in KINDS[1:]:
      out[k] = {
        's': statistics.median(t for t, _ in runs[k]),
        'ratio': statistics.median(t / b for (t, _), b in zip(runs[k], base)),
        'extra_ms_per_call': statistics.median(
          1e3 * (t - b) / n for (t, n), b in zip(runs[k], base)
        ),
      }
    return out

  def per_call(self) -> dict:
    """Microseconds per environment step, without the engine, over a
    conversation of `--turns` calls (a chat call resends the history)."""
    n, a = self.args.calls, self.args
    out = {k: [] for k in KINDS}
    for r in range(a.reps):
      for kind in rotate(KINDS, r):
        t = 0.0
        for _ in range(n // a.turns):
          env = self.env(kind, a.turns)
          env.reset(self.row)
          t0 = time.perf_counter()
          for _ in range(a.turns - 1):
            env.step('42')
          assert env.step('42').done
          t += time.perf_counter() - t0
          if kind != 'in_process':
            env.close()
        out[kind].append(1e6 * t / (n // a.turns * a.turns))
    return {k: statistics.median(v) for k, v in out.items()}


KINDS = ('in_process', 'openai', 'http')


def rotate(kinds, r: int):
  """The order of rep `r`: each kind first in turn (load drifts)."""
  r %= len(kinds)
  return kinds[r:] + kinds[:r]


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument('--turns', type=int, default=4)
  ap.add_argument('--turn_tokens', type=int, default=16)
  ap.add_argument('--obs', type=int, default=8, help='tool result digits')
  ap.add_argument('--prompt_chars', type=int, default=64)
  ap.add_argument('--trajectories', type=int, default=16)
  ap.add_argument('--slots', type=int, default=16)
  ap.add_argument('--hidden', type=int, default=64)
  ap.add_argument('--layers', type=int, default=2)
  ap.add_argument('--reps', type=int, default=5)
  ap.add_argument('--calls', type=int, default=64)
  args = ap.parse_args()
  bench = Bench(args)
  out = {'per_call': bench.per_call(), 'rollouts': bench.rollouts()}
  out['device'] = str(jax.devices()[0])
  print(json.dumps(out, indent=1))


if __name__ == '__main__':
  main()
