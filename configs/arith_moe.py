"""A tiny mixture-of-experts policy learns 2-digit addition from scratch.

configs/arith_tiny.py's task with a Mixtral-style policy: 2 layers, each
MLP an MoE block of 8 experts of width 96, top-2 (active MLP FLOPs per
token 2 x 96 = 192, half the dense default's 384). The engine runs in
bfloat16 and the trainer in float32, so their routers disagree on some
(token, layer) pairs; the trainer replays the engine's routing
(`moe.router_replay='rollout'`, R3) and adds a small Switch load-balancing
loss. docs/moe.md explains the knobs.

  python -m jaxcorr.main --config=configs/arith_moe.py --workdir=/tmp/moe
  python -m jaxcorr.main --config=configs/arith_moe.py:decoupled_token_is ...
  python -m jaxcorr.main --config=configs/arith_moe.py:pulse ...

The config string is arith_tiny's `[pulse+]<preset>`. The balance terms
need global loss normalisers: with a bypass preset set
`--config.moe.aux_loss_coef=0 --config.moe.z_loss_coef=0`.
"""

from __future__ import annotations

import ml_collections

from configs import arith_tiny, base


def apply_moe(config: ml_collections.ConfigDict) -> None:
  """The MoE policy, engine dtype and replay (values only, no new keys)."""
  config.model.architecture = 'MixtralForCausalLM'
  config.model.num_experts = 8
  config.model.num_experts_per_tok = 2
  config.model.intermediate_size = 96  # each expert's width
  config.rollout.engine_dtype = 'bfloat16'
  config.moe.router_replay = 'rollout'
  config.moe.aux_loss_coef = 0.01
  config.moe.z_loss_coef = 0.001


def get_config(config_string: str | None = None) -> ml_collections.ConfigDict:
  pulse, preset = arith_tiny.split(config_string)

  def task(config: ml_collections.ConfigDict) -> None:
    arith_tiny.apply_task(config)
    apply_moe(config)
    if pulse:
      arith_tiny.apply_pulse(config)
      config.model.intermediate_size = 32

  return base.get_config(preset, task=task)
