"""The teacher: resolved, checked against the student and the mesh at
start-up, loaded sharded like the policy in its own dtype.

A teacher path is a Hugging Face directory (config.json without
`checkpoints/`), a jaxcorr workdir (config.json and `checkpoints/`; its
latest step, or `workdir@STEP`), or a GGUF file, which must be converted
first (`python -m jaxcorr.convert`): resolved, checked and loaded by the
shared jaxcorr/train/checkpoints/model_source.py (the speculative draft
uses it too). Every refusal is one line naming `config.distill.teacher`
(or `.teachers`).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jaxcorr.config.fields import fail
from jaxcorr.model import Transformer
from jaxcorr.train.checkpoints import model_source
from jaxcorr.train.policy import transformer_config

FIELD = 'config.distill.teacher'


@flax.struct.dataclass
class Teacher:
  """A loaded teacher, a jit argument of `prepare`: its graph (static)
  and its params (on the policy's mesh, in `distill.teacher_dtype`)."""

  graphdef: Any = flax.struct.field(pytree_node=False)
  params: Any = None


TeacherSource = model_source.ModelSource
tokenizer_identity = model_source.tokenizer_identity
_teacher_tokenizer = model_source.source_tokenizer


def resolve(path: str, field: str = FIELD) -> TeacherSource:
  """The `TeacherSource` of a config value; refusals name `field`."""
  return model_source.resolve(path, field)


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
  return Teacher(*model_source.load_params(src, cfg, mesh))


def check_for_run(run: Any) -> tuple[TeacherSource, Any]:
  """Start-up checks that read files, no device: the path resolves, a
  workdir teacher is not LoRA, same tokenizer and vocabulary as the
  student. Returns (source, the teacher's TransformerConfig)."""
  cfg = run.distill
  src = resolve(cfg.teacher)
  t_cfg = model_source.checked_config(src, cfg.teacher_dtype, FIELD, 'teacher')
  s_cfg = transformer_config(run.model)
  student_tok = tokenizer_identity(run.model.hf_path, run.data.tokenizer)
  model_source.check_same_tokens(
    src, t_cfg, s_cfg, student_tok, FIELD, ('teacher', 'student')
  )
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
