"""The `moe` section's config-time rules (no device work)."""

from __future__ import annotations

import pytest

from jaxcorr.train import build
from tests.helpers.trainer_config import pulse_config


def test_defaults_are_off_and_bad_combinations_name_the_field():
  run = build.build(pulse_config())
  assert run.moe.router_replay == 'none' and run.moe.aux_loss_coef == 0
  with pytest.raises(ValueError, match=r'config\.moe\.router_replay'):
    build.build(pulse_config('bypass_pg_is', moe__router_replay='old'))
  with pytest.raises(ValueError, match=r'config\.moe\.aux_loss_coef'):
    build.build(pulse_config('bypass_pg_is', moe__aux_loss_coef=0.01))
  with pytest.raises(ValueError, match=r'config\.moe\.router_replay'):
    build.build(pulse_config(moe__router_replay='r3'))
