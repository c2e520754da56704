"""jaxcorr/train/state.py: what the device side carries from step to step."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jaxcorr import sharding
from jaxcorr.train.state import copy_tree
from tests.helpers.model_testing import random_model, tiny_config


def test_copy_tree_keeps_each_sharding_as_it_is_spelled():
  """The reference and the critic are copies of the policy after SFT: in
  XLA's respelling of the policy's shardings (P('fsdp',) for P('fsdp',
  'tensor'), what a jitted copy returned), a fresh run's `prepare` was
  another program than a resumed run's (issue 38; the whole run:
  tests/train/test_loop.py::test_resume_is_exact)."""
  mesh = sharding.make_mesh(sharding.MeshConfig(1, -1, 1))
  params = nnx.state(random_model(tiny_config()))
  params = jax.device_put(params, sharding.param_shardings(params, mesh))
  copy = copy_tree(params)
  pairs = list(zip(jax.tree.leaves(params), jax.tree.leaves(copy)))
  assert len(pairs) > 20
  for a, b in pairs:
    assert b.sharding == a.sharding, (a.sharding, b.sharding)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # A copy: donating the original (the update does) leaves it intact.
  jax.jit(lambda t: t, donate_argnums=0)(jax.tree.leaves(params)[0])
  assert not jax.tree.leaves(copy)[0].is_deleted()
