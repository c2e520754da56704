"""An OpenEnv environment (openenv-core) trained on the embedded tiny model
over bytes, no downloads:

  python -m jaxcorr.main --config=configs/openenv_tiny.py --workdir=/tmp/oe
  python -m jaxcorr.main --config=configs/openenv_tiny.py:pulse ...

The environment is `SumGame`, written here on OpenEnv's own classes
(`Environment`, `Action`, `Observation`) and served by OpenEnv's
`create_app` on loopback when this config loads; the trainer reaches it
as any OpenEnv server, over OpenEnv's client, one WebSocket session per
trajectory (jaxcorr/hubs/openenv_env.py). It builds its own data: reset
with a seed draws a sum of two digits, the agent answers, the game says
'higher' or 'lower' (reward 0) until the answer is right (reward 1, done)
or `TRIES` answers are spent. openenv-core ships no environment of its
own (only the echo template of `openenv init`), hence this one. The
reward is the game's: `reward.functions='exact_match:0'`. The config
string is `[pulse+]<preset>` as in configs/arith_tiny.py.
"""

from __future__ import annotations

import random

import ml_collections
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from configs import arith_tiny, env_tiny
from jaxcorr.agents.environment import ENVIRONMENTS
from jaxcorr.endpoint.server import ThreadedServer
from jaxcorr.hubs.openenv_env import register_openenv

NAME = 'openenv_sum'
TRIES = 3
SESSIONS = 256  # concurrent trajectories (OpenEnv's default is 1)


class SumAction(Action):
  answer: str


class SumObservation(Observation):
  text: str = ''


class SumGame(Environment):
  """Answer a+b; 'higher' / 'lower' until right or `TRIES` answers."""

  SUPPORTS_CONCURRENT_SESSIONS = True

  def __init__(self):
    super().__init__()
    self._state = State(step_count=0)
    self.target = 0

  def reset(self, seed=None, episode_id=None, **kwargs) -> SumObservation:
    rng = random.Random(seed)
    a, b = rng.randrange(10), rng.randrange(10)
    self.target = a + b
    self._state = State(episode_id=episode_id, step_count=0)
    return SumObservation(text=f'{a}+{b}=')

  def step(self, action: SumAction, timeout_s=None, **kwargs) -> SumObservation:
    self._state.step_count += 1
    answer = action.answer.strip()
    guess = int(answer) if answer.isdigit() else -1
    if guess == self.target:
      return SumObservation(text='right', reward=1.0, done=True)
    hint = 'higher' if guess < self.target else 'lower'
    done = self._state.step_count >= TRIES
    return SumObservation(text=hint, reward=0.0, done=done)

  @property
  def state(self) -> State:
    return self._state


def serve() -> ThreadedServer:
  """OpenEnv's server of `SumGame` on a free loopback port (uvicorn's
  errors unlogged: OpenEnv's WebSocket endpoint raises on every client
  that closes its session; real failures reach the client)."""
  app = create_app(
    SumGame, SumAction, SumObservation, max_concurrent_envs=SESSIONS
  )
  return ThreadedServer(app, log_level='critical')


if NAME not in ENVIRONMENTS:  # a config module loaded twice: once
  SERVER = serve()
  register_openenv(NAME, SERVER.url, role='tool')


def apply_task(config: ml_collections.ConfigDict) -> None:
  """configs/env_tiny.py's model and budgets, in the OpenEnv game."""
  env_tiny.apply_task(config)
  config.agent.environment = NAME
  config.agent.max_turns = TRIES
  config.reward.functions = 'exact_match:0'
  config.train.sft_steps = 0


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  return arith_tiny.task_config(config_string, apply_task, sft_steps=0)
