"""verifiers environments (prime-rl's environment library; `verifiers` 0.4,
its `verifiers.v1` stack) trained through the OpenAI-compatible endpoint.

    agent = register_verifiers('name', {'taskset': {'id': 'my_taskset'}})
    agent.write_rows('/tmp/rows.jsonl')   the taskset as the trainer's data
    --config.agent.environment=name --config.data.source=jsonl ...

verifiers runs an episode itself: its `Env.run` plays the task (one
turn, or a game loop of `interaction.turn`s), its harness program calls
the model through verifiers' interception server, and its task's
`@vf.reward` functions (the rubric) score the trace. The adapter makes
that episode the agent of one trajectory: the agent program of
jaxcorr/endpoint runs `env.run_episode(task, ctx)` with the model
context's base_url the trajectory's session, so every model call of the
episode is a turn the engine samples (ids, μ and versions recorded), and
returns the rubric's weighted sum, the trajectory's turn reward. An
episode that verifiers reports failed (`episode.ok` false: a hook, the
harness or a reward raised) fails its row (jaxcorr/agents/failures.py).

Data: `write_rows` writes the taskset's tasks as JSONL rows (`prompt`:
the task's prompt text, `answer`: its index), so the trainer's loader
draws tasks and the agent looks each up by index; the prompt the model
sees is the harness's first call, not the row's text.

The harness: `inprocess` (`InProcessHarness`, this module) is a chat
program run in the trainer's process (one completion per segment, the
conversation replayed on resume, as verifiers' `null` harness does):
the `null` harness starts a Python subprocess per segment (7 s each on
the 2-core CPU), which a training step of dozens of episodes cannot
afford. Any other harness id is used as it is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import sys
import threading
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.utils import loaders

from jaxcorr.endpoint import AgentCall, EndpointSettings, register_agent
from jaxcorr.endpoint.environment import http_client

HARNESS = 'jaxcorr_inprocess_harness'  # InProcessHarness's plugin id


class InProcessHarnessConfig(vf.HarnessConfig):
  pass


class InProcessHarness(vf.Harness[InProcessHarnessConfig]):
  """One chat completion per segment, in this process (module docstring)."""

  APPENDS_SYSTEM_PROMPT = True
  SUPPORTS_RESUME = True
  EXECUTES_CODE = False
  NEEDS_CONTAINER = False

  async def launch(
    self,
    ctx: vf.ModelContext,
    trace: vf.Trace,
    runtime: vf.Runtime,
    endpoint: str,
    secret: str,
    mcp_urls: dict[str, str],
    data: vf.TaskData,
    tool_interception_url: str | None = None,
  ) -> vf.ProgramResult:
    import openai

    system, prompt = self.resolve_prompt(data)
    messages = [{'role': 'system', 'content': system}] if system else []
    if isinstance(prompt, str):
      messages.append({'role': 'user', 'content': prompt})
    elif prompt:
      messages += [message_to_wire(m) for m in prompt]
    client = openai.AsyncOpenAI(
      base_url=endpoint, api_key=secret, max_retries=0
    )
    try:
      reply = await client.chat.completions.create(
        model=ctx.model, messages=messages
      )
    finally:
      await client.close()
    return vf.ProgramResult(0, reply.choices[0].message.content or '', '')


__all__ = ['InProcessHarness']


def plugin(module_name: str, alias: str) -> str:
  """`alias`, a top-level module name for `module_name`, as verifiers'
  plugin ids must be (its loader looks `verifiers.v1.harnesses.<id>` up
  first, which fails for a dotted id); returns the alias."""
  sys.modules.setdefault(alias, sys.modules[module_name])
  return alias


plugin(__name__, HARNESS)


class VerifiersAgent:
  """The agent program of one verifiers environment (module docstring):
  its episodes run on one event loop thread of their own."""

  def __init__(self, env_config: dict[str, Any], limit: int, timeout_s: float):
    self.config = loaders.resolve_env_config(env_config)
    self.env = loaders.load_environment(self.config)
    taskset = loaders.load_taskset(self.config.taskset)
    self.tasks = list(taskset.take(limit) if taskset.INFINITE else taskset)
    self.timeout_s = timeout_s
    self.loop = asyncio.new_event_loop()
    threading.Thread(
      target=self.loop.run_forever, name='verifiers', daemon=True
    ).start()

  def write_rows(self, path: str) -> int:
    """The tasks as JSONL rows (prompt text, index as the answer), written
    atomically; the number of rows."""
    tmp = f'{path}.tmp'
    with open(tmp, 'w') as f:
      for i, task in enumerate(self.tasks):
        prompt = task.data.prompt
        text = prompt if isinstance(prompt, str) else json.dumps(str(prompt))
        f.write(json.dumps({'prompt': text, 'answer': str(i)}) + '\n')
    os.replace(tmp, path)
    return len(self.tasks)

  def __call__(self, call: AgentCall) -> float:
    task = self.tasks[int(call.row.answer)]
    client = vf.EvalClientConfig(base_url=call.base_url, api_key_var='')
    ctx = vf.ModelContext(model=call.model, client=client)
    future = asyncio.run_coroutine_threadsafe(
      self.env.run_episode(task, ctx), self.loop
    )
    try:
      episode = future.result(self.timeout_s)
    except concurrent.futures.TimeoutError:
      future.cancel()
      raise TimeoutError(
        f'the verifiers episode took over {self.timeout_s:g} s'
      ) from None
    if not episode.ok:
      errors = [e.message for e in episode.errors] or ['a trace failed']
      raise RuntimeError(f'verifiers episode failed: {errors[0]}')
    return sum(
      r.score * r.weight for t in episode.traces for r in t.rewards.values()
    )


def register_verifiers(
  name: str,
  env_config: dict[str, Any],
  *,
  limit: int = 1024,
  settings: EndpointSettings | None = None,
) -> VerifiersAgent:
  """Environment `name` plays the verifiers environment `env_config` (a
  `verifiers.v1` env config: its `taskset`, and its agent seats; a seat
  without a harness gets `InProcessHarness` on the subprocess runtime);
  the first `limit` tasks of an infinite taskset."""
  settings = settings or EndpointSettings()
  config = json.loads(json.dumps(env_config))  # a copy the seats fill
  seats = [
    k for k, v in config.items() if isinstance(v, dict) and k != 'taskset'
  ]
  for seat in seats or ['agent']:
    config.setdefault(seat, {}).setdefault('harness', {'id': HARNESS})
    config[seat].setdefault('runtime', {'type': 'subprocess'})
  agent = VerifiersAgent(config, limit, settings.agent_timeout_s)
  register_agent(name, agent, settings)
  http_client()  # the pool exists before the episodes' threads race for it
  return agent
