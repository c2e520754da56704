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
from jaxcorr.data import task_ids
from jaxcorr.model import Transformer
from jaxcorr.model.lora import apply_lora, split_adapter
from jaxcorr.train.checkpoints import model_source
from jaxcorr.train.distill import routes
from jaxcorr.train.policy import transformer_config

FIELD = 'config.distill.teacher'


@flax.struct.dataclass
class Teacher:
  """A loaded teacher, a jit argument of `prepare`: its graph (static)
  and its params (on the policy's mesh, in `distill.teacher_dtype`)."""

  graphdef: Any = flax.struct.field(pytree_node=False)
  params: Any = None


@flax.struct.dataclass
class Teachers:
  """Several teachers (MOPD, `distill.teachers`), a jit argument of
  `prepare`: each loaded `Teacher`, their names (the `distill/<name>/`
  metrics) and the task id -> teacher index table (`distill.routes`)."""

  members: tuple[Teacher, ...]
  names: tuple[str, ...] = flax.struct.field(pytree_node=False)
  route: tuple[int, ...] = flax.struct.field(pytree_node=False)


def param_bytes(cfg: Any) -> int:
  """Bytes of the teacher's parameters (shapes only, nothing allocated)."""
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  return _nbytes(nnx.state(abstract))


def _nbytes(tree: Any) -> int:
  leaves = jax.tree.leaves(tree)
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in leaves)


def student_bytes(run: Any) -> int:
  """Bytes the student's training state keeps resident: what trains 4x
  (params, two Adam moments, gradients) and, with LoRA, the frozen base
  once (it has no moments and no gradients; `TrainState.frozen`)."""
  cfg = transformer_config(run.model)

  def build():
    module = Transformer(cfg, rngs=nnx.Rngs(0))
    return apply_lora(module, run.lora) if run.lora.enabled else module

  state = nnx.state(nnx.eval_shape(build))
  if not run.lora.enabled:
    return 4 * _nbytes(state)
  adapter, frozen = split_adapter(state)
  return 4 * _nbytes(adapter) + _nbytes(frozen)


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
  """The teachers' share per device (their params split over the mesh's
  fsdp x tensor axes, as the policy's are) plus the student's resident
  training state (`student_bytes(run)`) must fit in `limit`."""
  if limit is None:
    return
  shards = 1
  for axis in ('fsdp', 'tensor'):
    if axis in mesh.shape:
      shards *= mesh.shape[axis]
  need = (nbytes + student_bytes) / shards
  if need > limit:
    fail(
      field, path,
      'teachers that fit the mesh with the student',
      f'{need / 2**30:.2f} GiB per device (teacher {nbytes / 2**30:.2f} GiB '
      f'+ student state {student_bytes / 2**30:.2f} GiB over {shards} '
      f'shards) > {limit / 2**30:.2f} GiB; raise mesh.fsdp or use '
      'teacher_dtype=bfloat16',
    )  # fmt: skip


def load(
  src: model_source.ModelSource, cfg: Any, mesh: jax.sharding.Mesh
) -> Teacher:
  """The teacher's params on `mesh`, sharded by the policy's rules."""
  return Teacher(*model_source.load_params(src, cfg, mesh))


def _field(run: Any, name: str) -> str:
  """The field a refusal names: `teacher`, or `teachers[name]`."""
  return FIELD if run.distill.teacher else f'{routes.TEACHERS_FIELD}[{name}]'


def check_for_run(run: Any) -> tuple[tuple[model_source.ModelSource, Any], ...]:
  """Start-up checks that read files, no device, for every teacher: the
  path resolves, a workdir teacher is not LoRA, same tokenizer and
  vocabulary as the student; and every task of config.data has a teacher
  (`routes.route_table`). Returns each teacher's (source, its
  TransformerConfig), in `distill.members` order."""
  cfg = run.distill
  # Tokens and vocabulary only: no backend asked for model.dtype='auto'.
  s_cfg = transformer_config(run.model, backend='cpu')
  student_tok = model_source.tokenizer_identity(
    run.model.hf_path, run.data.tokenizer
  )
  out = []
  for name, path in cfg.members:
    field = _field(run, name)
    src = model_source.resolve(path, field)
    t_cfg = model_source.checked_config(
      src, cfg.teacher_dtype, field, 'teacher'
    )
    model_source.check_same_tokens(
      src, t_cfg, s_cfg, student_tok, field, ('teacher', 'student')
    )
    out.append((src, t_cfg))
  route_for_run(run)
  return tuple(out)


def route_for_run(run: Any) -> tuple[int, ...]:
  """Task id (jaxcorr/data/task_ids.py) -> teacher index: every task to
  `distill.teacher`, or `distill.routes` over `distill.teachers`."""
  tasks = task_ids.task_names(run.data)
  if run.distill.teacher:
    return (0,) * len(tasks)
  names = [n for n, _ in run.distill.members]
  pairs = routes.parse_routes(run.distill.routes, names)
  return routes.route_table(tasks, names, pairs)


def for_run(run: Any, mesh: jax.sharding.Mesh) -> Teacher | Teachers | None:
  """The run's teacher on `mesh` (None without `config.distill`; a
  `Teachers` with `distill.teachers`), after `check_for_run` and the
  memory check against one device: every teacher's params with the
  student's resident state (`check_fits`, `student_bytes`)."""
  if not run.distill.enabled:
    return None
  checked = check_for_run(run)
  members = run.distill.members
  check_fits(
    sum(param_bytes(t_cfg) for _, t_cfg in checked),
    mesh,
    device_bytes(),
    student_bytes=student_bytes(run),
    field=FIELD if run.distill.teacher else routes.TEACHERS_FIELD,
    path=run.distill.teacher or run.distill.teachers,
  )
  loaded = tuple(load(src, t_cfg, mesh) for src, t_cfg in checked)
  if run.distill.teacher:
    return loaded[0]
  return Teachers(loaded, tuple(n for n, _ in members), route_for_run(run))
