"""Shared helpers for the model tests: tiny configs and random checkpoints."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxcorr import sharding
from jaxcorr.model import (
  Transformer,
  TransformerConfig,
  naive_token_logprobs,
  token_logprobs,
)

VOCAB = 128

# Jitted entry points: the tests call these, never the eager op-by-op path.
logprobs = nnx.jit(
  token_logprobs, static_argnames=('return_entropy', 'chunk_size')
)
naive_logprobs = nnx.jit(
  naive_token_logprobs, static_argnames=('return_entropy',)
)


@nnx.jit
def forward(model, tokens, segment_ids=None):
  return model(tokens, segment_ids=segment_ids)


@nnx.jit
def hidden(model, tokens, segment_ids=None):
  return model.hidden_states(tokens, segment_ids=segment_ids)[0]


def tiny_config(**changes) -> TransformerConfig:
  """A Qwen2-shaped model (q/k/v biases): 8 query heads over 2 KV heads."""
  base = dict(
    architecture='Qwen2ForCausalLM',
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    qkv_bias=True,
    initializer_range=0.15,
  )
  base.update(changes)
  return TransformerConfig(**base)


def random_model(cfg: TransformerConfig, seed: int = 0) -> Transformer:
  """A model with random weights, norms and biases (not 1s and 0s).

  Values come from NumPy into an abstract model: a jitted NNX init spends
  seconds compiling threefry for every param, which these tests do not need.
  """
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(seed)
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    noise = rng.normal(size=var.shape).astype(np.float32)
    if path[-1] == 'scale':
      value = 1.0 + 0.2 * noise
    elif path[-1] == 'bias':
      value = 0.2 * noise
    else:
      value = cfg.initializer_range * noise
    var.set_value(jnp.asarray(value, cfg.param_dtype))
  return model


def random_tokens(batch: int, seq: int, seed: int = 0) -> jax.Array:
  return jnp.asarray(
    np.random.default_rng(seed).integers(0, VOCAB, (batch, seq)), jnp.int32
  )


def stack_layers(state: nnx.State) -> dict:
  """Flat {path: array} of a state in scan layout: ('layers', i, ...) of a
  list-of-layers state stacked into ('layers', ...); a scan state as is."""
  flat = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(state)}
  out, layers = {}, {}
  for p, x in flat.items():
    if p[0] == 'layers' and isinstance(p[1], int):
      layers.setdefault((p[0], *p[2:]), {})[p[1]] = x
    else:
      out[p] = x
  for p, by_index in layers.items():
    out[p] = jnp.stack([by_index[i] for i in sorted(by_index)])
  return out


def flat_values(state: nnx.State) -> dict:
  return {tuple(p): v.get_value() for p, v in nnx.to_flat_state(state)}


def with_config(model: Transformer, **changes) -> Transformer:
  """The same weights under `model.config.replace(**changes)`; a change of
  `scan_layers` restacks the layer params."""
  cfg = model.config.replace(**changes)
  out = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  state = nnx.state(model, nnx.Param)
  if cfg.scan_layers == model.config.scan_layers:
    values = flat_values(state)
  elif cfg.scan_layers:
    values = stack_layers(state)
  else:
    values = {}
    for p, x in flat_values(state).items():
      if p[0] != 'layers':
        values[p] = x
        continue
      for i in range(cfg.num_layers):
        values[(p[0], i, *p[1:])] = x[i]
  for p, var in nnx.to_flat_state(nnx.state(out, nnx.Param)):
    var.set_value(values[tuple(p)].astype(cfg.param_dtype))
  return out


def shard_batch(batch, mesh):
  """`device_put` every array of a batch pytree with `batch_sharding`.

  Rows must divide by data x fsdp; a batch that does not is an input error,
  so it raises instead of silently replicating.
  """
  n = math.prod(mesh.shape[a] for a in ('data', 'fsdp'))

  def put(x):
    x = np.asarray(x) if not isinstance(x, jax.Array) else x
    if x.ndim == 0:
      return jax.device_put(x, NamedSharding(mesh, PartitionSpec()))
    if x.shape[0] % n:
      raise ValueError(f'batch of {x.shape[0]} rows does not split over {n}')
    return jax.device_put(x, sharding.batch_sharding(mesh, x.ndim))

  return jax.tree.map(put, batch)


def fresh_train_state(run, mesh, *, sharded: bool = False):
  """(state, steps) of a step-0 trainer for `run` on `mesh`: a random
  policy (seed 0), with `run.critic.enabled` a random critic (seed 1, its
  head nudged off zero so values differ per position), a zero KL
  coefficient; what the step tests feed `Steps.prepare` / `RLStep`
  directly, without `setup.make_state` (`sharded`: the params initialised
  on `mesh`, else on one device)."""
  from jaxcorr.losses import rewards
  from jaxcorr.train.critic import ValueModel
  from jaxcorr.train.policy import transformer_config
  from jaxcorr.train.state import TrainState, make_optimizer
  from jaxcorr.train.step import Steps

  cfg = transformer_config(run.model)

  def init(make):
    if sharded:  # params laid out on `mesh` by their logical axes
      return sharding.init_sharded(make, mesh)
    return make()

  model = init(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(model)
  tx, schedule = make_optimizer(run.optim, 1e-3, 10)
  critic = {}
  if run.critic.enabled:
    value_model = init(lambda: ValueModel(cfg, rngs=nnx.Rngs(1)))
    head = np.linspace(-1, 1, cfg.hidden_size, dtype=np.float32)
    value_model.head[...] = jnp.asarray(head, value_model.head[...].dtype)
    critic_graphdef, critic_params = nnx.split(value_model)
    critic_tx, _ = make_optimizer(run.optim, 1e-3, 10)
    critic = dict(critic_graphdef=critic_graphdef, critic_tx=critic_tx)
  with jax.set_mesh(mesh):
    state = TrainState(
      params=params,
      opt_state=jax.jit(tx.init)(params),
      kl_ctrl=rewards.KLControllerState(coef=jnp.zeros(())),
      rng=jax.random.PRNGKey(0),
      updates=jnp.zeros((), jnp.int32),
    )
    if critic:
      state = state.replace(
        critic_params=critic_params,
        critic_opt_state=jax.jit(critic_tx.init)(critic_params),
      )
  return state, Steps(run, graphdef, tx, schedule, **critic)


def foreign_tokenizer_hf_dir(path) -> str:
  """A one-layer Llama HF directory (config.json, vocabulary 27) whose
  tokenizer.json marks it as an HF tokenizer: a model with the scratch
  students' vocabulary size but another tokenizer identity."""
  path.mkdir()
  (path / 'config.json').write_text(
    json.dumps({
      'architectures': ['LlamaForCausalLM'], 'vocab_size': 27,
      'hidden_size': 32, 'intermediate_size': 64, 'num_hidden_layers': 1,
      'num_attention_heads': 2, 'num_key_value_heads': 1,
      'max_position_embeddings': 32, 'rms_norm_eps': 1e-5,
    })
  )  # fmt: skip
  (path / 'tokenizer.json').write_text('{}')
  return str(path)
