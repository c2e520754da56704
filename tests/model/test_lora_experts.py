"""LoRA on MoE experts (jaxcorr/model/lora_experts.py): a fresh adapter
(B = 0) leaves a Qwen2-MoE policy's log-probs bit-identical, the grouped
and dense dispatches add the same per-expert term, merging gives
W_e + alpha / r · A_e B_e per expert, each expert's adapter gets gradients
exactly where the router sends tokens, and the adapters shard like the
experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec

from jaxcorr import sharding
from jaxcorr.model import Transformer, token_logprobs
from jaxcorr.model import lora as lora_lib
from jaxcorr.model.lora_experts import ExpertLora
from jaxcorr.model.moe import EXPERT_PROJECTIONS
from tests.model.test_moe import TOKENS, moe_config

LC = lora_lib.LoraConfig(rank=4, alpha=8.0, target_modules=lora_lib.TARGETS)


def _cfg(**changes):
  """Qwen2-MoE, 2 layers: a dense first one, then 8 experts and a gated
  shared expert."""
  base = dict(
    architecture='Qwen2MoeForCausalLM',
    num_layers=2,
    qk_norm=False,
    shared_expert_intermediate_size=24,
  )
  return moe_config(**{**base, **changes})


def _graphdef(make):
  return nnx.graphdef(nnx.eval_shape(make))


@jax.jit
def _noise(adapter):
  keys = iter(jax.random.split(jax.random.key(1), 256))
  return jax.tree.map(
    lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape), adapter
  )


def _logp_fn(graphdef):
  return jax.jit(lambda s: token_logprobs(nnx.merge(graphdef, s), TOKENS))


# Stacked (scan_layers: every layer MoE, adapters [L, E, in, r]): slow.
@pytest.mark.parametrize(
  'scan', [False, pytest.param(True, marks=pytest.mark.slow)]
)
def test_expert_adapters_fresh_merged_grouped_and_dense(scan):
  cfg = _cfg(scan_layers=True, mlp_only_layers=()) if scan else _cfg()
  model = nnx.jit(lambda: lora_lib.lora_model(cfg, LC))()
  state = nnx.state(model)
  adapter, frozen = lora_lib.split_adapter(state)
  # Every MoE layer: 3 stacked expert adapters [E, in, r] + 3 on the
  # shared expert; the dense layer 3; attention 4 per layer.
  pure = nnx.to_pure_dict(adapter)['layers']
  moe = pure if scan else pure[1]
  lead = (2,) if scan else ()
  assert moe['mlp']['gate_proj']['lora']['lora_a'].shape == (*lead, 8, 32, 4)
  assert moe['mlp']['down_proj']['lora']['lora_b'].shape == (*lead, 8, 4, 32)
  assert moe['mlp']['shared_expert']['up_proj']['lora']['lora_b'].shape
  n = 4 + 6 if scan else 2 * 4 + 3 + 6
  assert len(jax.tree.leaves(adapter)) == 2 * n
  assert 'router' not in moe['mlp']

  plain = _graphdef(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  base_state = nnx.state(
    nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  )
  base_state = jax.tree.map(lambda x: x, base_state)
  nnx.replace_by_pure_dict(
    base_state, lora_lib.plain_pure(nnx.to_pure_dict(state))
  )
  ref = np.asarray(_logp_fn(plain)(base_state))
  lora_graph = nnx.graphdef(model)
  # B = 0: bit-identical log-probs, whatever A is.
  np.testing.assert_array_equal(np.asarray(_logp_fn(lora_graph)(state)), ref)

  trained = lora_lib.join(frozen, _noise(adapter))
  grouped = np.asarray(_logp_fn(lora_graph)(trained))
  assert np.abs(grouped - ref).max() > 1e-2
  dense_graph = _graphdef(
    lambda: lora_lib.lora_model(cfg.replace(moe_dispatch='dense'), LC)
  )
  dense = np.asarray(_logp_fn(dense_graph)(trained))
  np.testing.assert_allclose(dense, grouped, rtol=1e-5, atol=1e-5)
  # The merged kernels (W_e + alpha / r A_e B_e per expert) decode the
  # same function through the plain graph (grouped dispatch; the dense
  # one is the grouped one above).
  merged = jax.jit(lambda s: lora_lib.merge_into(base_state, s, LC.scale))(
    trained
  )
  got = np.asarray(_logp_fn(plain)(merged))
  np.testing.assert_allclose(got, grouped, rtol=1e-5, atol=1e-5)


def test_each_expert_adapter_learns_where_tokens_are_routed():
  cfg = _cfg(shared_expert_intermediate_size=0, mlp_only_layers=())
  lc = lora_lib.LoraConfig(rank=2, target_modules='gate_proj,up_proj,down_proj')
  model = nnx.jit(lambda: lora_lib.lora_model(cfg, lc))()
  graphdef = nnx.graphdef(model)
  adapter, frozen = lora_lib.split_adapter(nnx.state(model))
  adapter = _noise(adapter)
  tokens = TOKENS[:1, :3]  # 3 tokens x top-2: some experts see none

  @jax.jit
  def grads(adapter):
    def loss(adapter):
      m = nnx.merge(graphdef, lora_lib.join(frozen, adapter))
      h, _, stats = m.routed_hidden_states(tokens)
      return jnp.sum(jnp.tanh(m.logits(h))), stats

    return jax.grad(loss, has_aux=True)(adapter)

  g, stats = grads(adapter)
  g = nnx.to_pure_dict(g)['layers']
  experts = np.asarray(stats.experts)[0]  # [S, L, k]
  for layer in range(cfg.num_layers):
    used = set(experts[:, layer].ravel().tolist())
    assert 0 < len(used) < cfg.num_experts
    for name in EXPERT_PROJECTIONS:
      node = g[layer]['mlp'][name]['lora']
      for leaf in ('lora_a', 'lora_b'):
        moved = np.abs(np.asarray(node[leaf])).reshape(8, -1).max(-1) > 0
        assert set(np.flatnonzero(moved).tolist()) == used, (layer, name)


def test_expert_adapters_shard_like_the_experts():
  for scan in (False, True):
    cfg = _cfg(scan_layers=scan, mlp_only_layers=(), num_layers=3)
    model = nnx.eval_shape(lambda cfg=cfg: lora_lib.lora_model(cfg, LC))
    mesh = AbstractMesh((1, 2, 1, 1), sharding.MESH_AXES)
    found = 0
    for _, m in nnx.iter_graph(model):
      if not isinstance(m, ExpertLora):
        continue
      kernel = m.base.get_metadata()['logical_axes']
      for v in (m.lora.lora_a, m.lora.lora_b):
        axes = v.get_metadata()['logical_axes']
        assert axes.index('expert') == kernel.index('expert')
        spec = sharding.logical_to_spec(axes, shape=v.shape, mesh=mesh)
        lead = (None,) if scan else ()
        assert spec == PartitionSpec(*lead, 'fsdp', None, None)
        found += 1
    assert found == 6 * (1 if scan else cfg.num_layers)


@pytest.mark.slow  # the budget: LoraLinear's dropout test covers the key
def test_expert_dropout_only_with_a_key():
  cfg = _cfg(shared_expert_intermediate_size=0, mlp_only_layers=())
  lc = lora_lib.LoraConfig(rank=2, dropout=0.5, target_modules='up_proj')
  model = nnx.jit(lambda: lora_lib.lora_model(cfg, lc))()
  graphdef = nnx.graphdef(model)
  adapter, frozen = lora_lib.split_adapter(nnx.state(model))
  state = lora_lib.join(frozen, _noise(adapter))

  @jax.jit
  def logp(state, key):
    m = nnx.merge(graphdef, state)
    if key is not None:
      lora_lib.enable_dropout(m, key)
    return token_logprobs(m, TOKENS)

  plain = np.asarray(logp(state, None))
  assert np.abs(np.asarray(logp(state, jax.random.key(3))) - plain).max() > 1e-4
