"""`jaxcorr.parity.measure.trained_adapter`: a LoRA run is measured with
a nonzero adapter (B drawn at random), A and everything else kept."""

import jax
import numpy as np
from flax import nnx

from jaxcorr.parity.measure import LORA_B_STD, trained_adapter
from jaxcorr.train.state import TrainState


def test_trained_adapter_draws_b_and_keeps_a():
  lora = nnx.LoRA(16, 4, 32, rngs=nnx.Rngs(0))
  params = nnx.state(lora, nnx.LoRAParam)
  assert not np.asarray(params['lora_b'].get_value()).any()  # B = 0 at init
  state = TrainState(
    params=params, opt_state=None, kl_ctrl=None, rng=None, updates=None
  )
  out = trained_adapter(state).params
  b = np.asarray(out['lora_b'].get_value())
  assert b.shape == (4, 32) and b.dtype == np.float32
  assert 0.5 * LORA_B_STD < b.std() < 2 * LORA_B_STD
  np.testing.assert_array_equal(
    out['lora_a'].get_value(), params['lora_a'].get_value()
  )
  again = trained_adapter(state).params['lora_b'].get_value()
  np.testing.assert_array_equal(b, again)  # seeded: every run the same
  assert jax.tree.structure(out) == jax.tree.structure(params)
