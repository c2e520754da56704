"""LoRA on the policy (jaxcorr/model/lora.py): a fresh adapter (B = 0)
leaves every log-prob exactly as the base model's, the merged weights
decode the same function as base + adapter, dropout touches only a forward
given a key, and the config names its allowed targets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcorr.model import Transformer, TransformerConfig, token_logprobs
from jaxcorr.model import lora as lora_lib
from jaxcorr.model.lora import lora_model

_TOKENS = (jnp.arange(24, dtype=jnp.int32).reshape(2, 12) * 5) % 32


def _cfg(scan: bool) -> TransformerConfig:
  return TransformerConfig(
    vocab_size=32,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    scan_layers=scan,
  )


def _model(cfg, lc):
  """A LoRA Transformer, built in one jit (eager NNX init is slow)."""
  return nnx.jit(lambda: lora_model(cfg, lc))()


def _logp(graphdef, state, key=None):
  """token_logprobs of merge(graphdef, state) on _TOKENS (one jit: eager
  NNX op by op is slow)."""

  @jax.jit
  def run(state, key):
    model = nnx.merge(graphdef, state)
    if key is not None:
      lora_lib.enable_dropout(model, key)
    return token_logprobs(model, _TOKENS)

  return np.asarray(run(state, key))


def _perturbed(model):
  """The model's (adapter with random B, frozen base)."""
  adapter, frozen = lora_lib.split_adapter(nnx.state(model))

  @jax.jit
  def perturb(adapter):
    keys = iter(jax.random.split(jax.random.key(1), 64))
    return jax.tree.map(
      lambda x: x + 0.2 * jax.random.normal(next(keys), x.shape), adapter
    )

  return perturb(adapter), frozen


# Stacked (scan_layers) adapters: slow here; the PEFT test covers both.
@pytest.mark.parametrize(
  'scan', [False, pytest.param(True, marks=pytest.mark.slow)]
)
def test_fresh_adapter_is_the_base_model_and_merges_exactly(scan):
  cfg = _cfg(scan)
  lc = lora_lib.LoraConfig(rank=4, alpha=8.0, target_modules=lora_lib.TARGETS)
  model = _model(cfg, lc)
  graphdef = nnx.graphdef(model)
  # The base model: the same weights without the adapters.
  plain = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  nnx.replace_by_pure_dict(
    plain[1], lora_lib.plain_pure(nnx.to_pure_dict(nnx.state(model)))
  )
  ref = _logp(*plain)
  # B = 0: bit-identical log-probs, whatever A is.
  np.testing.assert_array_equal(_logp(graphdef, nnx.state(model)), ref)
  adapter, frozen = _perturbed(model)
  want = _logp(graphdef, lora_lib.join(frozen, adapter))
  assert np.abs(want - ref).max() > 1e-2
  merged = jax.jit(lambda s: lora_lib.merge_into(plain[1], s, lc.scale))(
    lora_lib.join(frozen, adapter)
  )
  np.testing.assert_allclose(
    _logp(plain[0], merged), want, rtol=1e-5, atol=1e-5
  )
  # Only LoRAParam leaves are adapters; one A and one B per target.
  n = len(lora_lib.TARGETS) * (1 if scan else cfg.num_layers)
  assert len(jax.tree.leaves(adapter)) == 2 * n
  assert not lora_lib.has_lora(frozen)


def test_dropout_only_with_a_key():
  cfg = _cfg(False)
  lc = lora_lib.LoraConfig(rank=4, dropout=0.5)
  model = _model(cfg, lc)
  adapter, frozen = _perturbed(model)
  graphdef = nnx.graphdef(model)
  state = lora_lib.join(frozen, adapter)
  plain = _logp(graphdef, state)
  dropped = _logp(graphdef, state, jax.random.key(3))
  assert np.abs(dropped - plain).max() > 1e-3
  # Without a key (scoring, the engine) the adapter never drops.
  np.testing.assert_array_equal(_logp(graphdef, state), plain)


def test_config_names_allowed_targets():
  assert lora_lib.LoraConfig(
    rank=2, target_modules='q_proj, down_proj'
  ).target_modules == ('q_proj', 'down_proj')
  with pytest.raises(ValueError, match=r'LoraConfig.target_modules.*qkv'):
    lora_lib.LoraConfig(rank=2, target_modules='qkv')
  assert not lora_lib.LoraConfig().enabled
