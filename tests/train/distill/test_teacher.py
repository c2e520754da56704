"""The teacher's start-up checks: each refusal one line naming
`config.distill.teacher`, before any device work."""

from __future__ import annotations

import jax
import pytest

from jaxcorr.train import build
from jaxcorr.train.checkpoints import model_source
from jaxcorr.train.distill import routes, teacher
from tests.helpers.model_testing import foreign_tokenizer_hf_dir
from tests.helpers.trainer_config import pulse_config

FIELD = r'config\.distill\.teacher'


def _workdir(path, **model):
  """A teacher workdir as the trainer writes one: the run's config.json
  (pulse model, `model` overrides) and a checkpoints/ folder."""
  config = pulse_config()
  for key, value in model.items():
    config.model[key] = value
  path.mkdir()
  (path / 'checkpoints').mkdir()
  (path / 'config.json').write_text(config.to_json())
  return str(path)


def _student(teacher_path):
  config = pulse_config()
  config.distill.teacher = teacher_path
  return config


def _one_line_error(config, match):
  with pytest.raises(ValueError, match=match) as e:
    build.build(config)
  assert '\n' not in str(e.value)


def test_matching_workdir_teacher_passes_the_checks(tmp_path):
  run = build.build(_student(_workdir(tmp_path / 't')))
  ((src, cfg),) = teacher.check_for_run(run)
  assert src.kind == 'workdir' and src.step is None
  assert cfg.vocab_size == run.model.vocab_size
  assert model_source.resolve(f'{src.path}@7', teacher.FIELD).step == 7


def test_missing_teacher(tmp_path):
  _one_line_error(_student(str(tmp_path / 'nowhere')), FIELD + '.*no such')


def test_gguf_teacher_needs_convert(tmp_path):
  _one_line_error(_student(str(tmp_path / 'm.gguf')), 'jaxcorr.convert')


def test_vocabulary_mismatch(tmp_path):
  path = _workdir(tmp_path / 't', vocab_size=64)
  _one_line_error(_student(path), FIELD + ".*student's vocabulary")


def test_tokenizer_mismatch_names_both(tmp_path):
  """An HF teacher (its tokenizer.json) for a scratch-tokenizer student."""
  path = foreign_tokenizer_hf_dir(tmp_path / 'hf')
  _one_line_error(_student(path), r'teacher hf:.* vs student scratch:')


def test_teacher_too_large_for_the_mesh():
  mesh = jax.make_mesh((1,), ('fsdp',))
  teacher.check_fits(2**30, mesh, None)  # unknown memory (CPU): no check
  teacher.check_fits(2**20, mesh, 2**30, student_bytes=2**20)
  with pytest.raises(ValueError, match=FIELD + r'.*GiB per device') as e:
    teacher.check_fits(2**30, mesh, 2**30, student_bytes=2**20, path='t')
  assert '\n' not in str(e.value)


def test_multi_teacher_route_table():
  names, tasks = ('code', 'math'), ('math', 'code', 'chat')
  table = routes.route_table(
    tasks, names, [('math', 'math'), ('code', 'code'), ('chat', 'math')]
  )
  assert table == (1, 0, 1)
  assert routes.route_table(tasks[:2], names, ()) == (1, 0)  # by name
  with pytest.raises(ValueError, match=r"distill\.routes.*'chat'") as e:
    routes.route_table(tasks, names, ())
  assert '\n' not in str(e.value)
  with pytest.raises(ValueError, match=r'distill\.teachers.*twice'):
    routes.parse_teachers('a=/x,a=/y')


def test_lora_student_counts_what_is_resident():
  """A LoRA student keeps its frozen base once (no moments, no
  gradients) and only the adapters 4x: a teacher that fits beside it is
  not refused as if every weight trained."""
  full = build.build(pulse_config())
  lora = build.build(pulse_config(lora__rank=2, train__sft_steps=0))
  base = teacher.param_bytes(teacher.transformer_config(full.model))
  assert teacher.student_bytes(full) == 4 * base
  small = teacher.student_bytes(lora)
  assert base < small < 2 * base  # base once + the (small) adapters 4x
  mesh = jax.make_mesh((1,), ('fsdp',))
  limit = base + small  # a same-size teacher beside the LoRA student
  teacher.check_fits(base, mesh, limit, student_bytes=small)
  with pytest.raises(ValueError, match=FIELD + r'.*GiB per device'):
    teacher.check_fits(base, mesh, limit, student_bytes=4 * base)


def test_scratch_workdir_teacher_has_its_own_tokenizer_identity(tmp_path):
  """A scratch-model workdir's ids are its data.tokenizer's, never the
  student's HF tokenizer (whatever the student is)."""
  src = model_source.resolve(_workdir(tmp_path / 't'), teacher.FIELD)
  assert model_source.source_tokenizer(src) == 'scratch:chars'
  assert model_source.tokenizer_identity('', 'bytes') == 'scratch:bytes'
