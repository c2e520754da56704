"""The trainer config the trainer tests build, and their length reward.

`pulse_config` is configs/arith_tiny.py's `pulse` config (a few seconds of
training on 8 fake CPU devices), optionally with a preset and with
`section__field=value` overrides, the one way the tests build a trainer
config. Importing this module registers `LENGTH_REWARD` once.
"""

from __future__ import annotations

from ml_collections import ConfigDict

from configs import arith_tiny
from jaxcorr import rewards as reward_fns

LENGTH_REWARD = 'test_response_length'
"""The response's length in characters, as a reward. An untrained pulse
model never solves a problem: with exact match alone every reward of a
GRPO group is equal, every advantage 0 and nothing moves; this reward
tells the group's responses apart."""

if LENGTH_REWARD not in reward_fns.REWARDS:
  reward_fns.register(LENGTH_REWARD)(lambda response, answer: len(response))


def pulse_config(
  preset: str = '', *, length_reward: bool = False, **overrides
) -> ConfigDict:
  """`configs/arith_tiny.py:pulse[+preset]` with `overrides`.

  Args:
    preset: a preset of configs/presets.py (or several joined by '+').
    length_reward: score `exact_match` plus 0.1 × `LENGTH_REWARD`.
    **overrides: `section__field=value`, e.g. `train__num_steps=4`.
  """
  c = arith_tiny.get_config('pulse+' + preset if preset else 'pulse')
  if length_reward:
    c.reward.functions = f'exact_match,{LENGTH_REWARD}:0.1'
  for path, value in overrides.items():
    section, field = path.split('__')
    c[section][field] = value
  return c
