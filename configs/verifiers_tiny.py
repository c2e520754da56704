"""A verifiers environment (`verifiers` 0.4, `verifiers.v1`) trained on the
embedded tiny model over bytes, through the OpenAI-compatible endpoint, no
downloads:

  python -m jaxcorr.main --config=configs/verifiers_tiny.py --workdir=/tmp/vf
  python -m jaxcorr.main --config=configs/verifiers_tiny.py:pulse ...

The environment is written here on verifiers' own classes: `SumTaskset`
builds its tasks (sums of two digits, seeded), `SumEnv.run` plays each as
a game over `interaction.turn`s ('higher' / 'lower' until right or
`TRIES` answers), and `SumTask`'s `@vf.reward` (the rubric) scores the
trace. verifiers runs every episode itself (its Env, harness and
interception server); jaxcorr/hubs/verifiers_env.py makes each episode the
agent of one trajectory, so the engine samples every model call and the
rubric's score is the trajectory's reward (`reward.functions=
'exact_match:0'`). The tasks are the trainer's rows: written as JSONL to
the system's temporary directory when this config loads. Why not an
environment verifiers ships: its textarena taskset downloads NLTK data at
load, its openenv taskset fails against openenv-core 0.3 (it reads
`GenericEnvClient._base_url`, which 0.3 does not have), and nemo_gym /
harbor need servers or containers. The config string is
`[pulse+]<preset>` as in configs/arith_tiny.py.
"""

from __future__ import annotations

import os
import random
import tempfile

import ml_collections
import verifiers.v1 as vf

from configs import arith_tiny, env_tiny
from jaxcorr.hubs.verifiers_env import plugin, register_verifiers

NAME = 'verifiers_sum'
TASKSET = plugin(__name__, 'jaxcorr_verifiers_sum')  # verifiers' plugin id
TRIES = 3
TASKS = 64
ROWS = os.path.join(tempfile.gettempdir(), 'jaxcorr_verifiers_sum.jsonl')


class SumData(vf.TaskData):
  answer: str


class SumTask(vf.Task[SumData]):
  @vf.reward(weight=1.0)
  async def solved(self, trace: vf.Trace) -> float:
    return float(trace.info.get('solved', 0.0))


class SumConfig(vf.TasksetConfig):
  tasks: int = TASKS


class SumEnvConfig(vf.EnvConfig):
  player: vf.AgentConfig = vf.AgentConfig()


class SumEnv(vf.Env[SumEnvConfig]):
  """The task's prompt opens; 'higher' / 'lower' until right or `TRIES`."""

  async def run(self, task, agents):
    async with agents.player.interaction(task) as interaction:
      segment = await interaction.turn()
      for tries in range(1, TRIES + 1):
        if segment.terminated:
          return
        reply = (segment.last_reply or '').strip()
        if reply == task.data.answer:
          interaction.trace.info['solved'] = 1.0
          return
        if tries == TRIES:
          return
        low = not reply.isdigit() or int(reply) < int(task.data.answer)
        segment = await interaction.turn('higher' if low else 'lower')


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
  def load(self):
    rng = random.Random(0)
    for _ in range(self.config.tasks):
      a, b = rng.randrange(10), rng.randrange(10)
      data = SumData(prompt=f'{a}+{b}=', answer=str(a + b))
      yield SumTask(data, self.config.task)


__all__ = ['SumEnv', 'SumTaskset']

AGENT = register_verifiers(NAME, {'taskset': {'id': TASKSET}, 'player': {}})
AGENT.write_rows(ROWS)


def apply_task(config: ml_collections.ConfigDict) -> None:
  """configs/env_tiny.py's model and budgets; the taskset's rows."""
  env_tiny.apply_task(config)
  config.data.source = 'jsonl'
  config.data.path = ROWS
  config.data.prompt_field = 'prompt'
  config.data.answer_format = 'raw'
  config.agent.environment = NAME
  config.agent.max_turns = TRIES
  config.reward.functions = 'exact_match:0'
  config.train.sft_steps = 0
  config.train.eval_every = 0


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  return arith_tiny.task_config(
    config_string, apply_task, sft_steps=0, eval_every=0
  )
