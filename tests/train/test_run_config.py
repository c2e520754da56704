"""Task configs x presets, and start-up errors of the trainer's config.

Every task config must build with every correction preset (the issue's
"each correction preset composes with each task config"), never gain keys
from a preset, and reject typos and invalid combinations before any device
work, with a message naming the field and the allowed values.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from configs import arith_tiny, base, gsm8k_qwen, llama8b_fsdp, presets
from jaxcorr.config import fields
from jaxcorr.train import build

ROOT = pathlib.Path(__file__).resolve().parents[2]
TASKS = {
  'arith_tiny': arith_tiny,
  'gsm8k_qwen': gsm8k_qwen,
  'llama8b_fsdp': llama8b_fsdp,
}
NAMES = [*presets.names(), 'decoupled_geo_rs+rollout_kl', 'rollout_kl']


def _flat_keys(cfg, prefix=''):
  keys = set()
  for k, v in cfg.items():
    if hasattr(v, 'items'):
      keys |= _flat_keys(v, f'{prefix}{k}.')
    else:
      keys.add(prefix + k)
  return keys


BASE_KEYS = _flat_keys(base.base_config())


@pytest.mark.parametrize('task', sorted(TASKS))
@pytest.mark.parametrize('name', NAMES)
def test_every_preset_composes_with_every_task(task, name):
  cfg = TASKS[task].get_config(name)
  assert _flat_keys(cfg) == BASE_KEYS
  run = build.build(cfg)
  want = presets.overrides(name)
  for path, value in want.items():
    section, field = path.split('.')
    assert cfg[section][field] == value, path
  # The task's own values survive the preset.
  assert run.train.num_steps == TASKS[task].get_config().train.num_steps
  if want.get('correction.mode') == 'bypass':
    assert not run.decoupled


def test_pulse_composes_with_presets():
  for name in ('bypass_pg_geo_rs', 'decoupled_seq_is_rs+rollout_kl'):
    cfg = arith_tiny.get_config(f'pulse+{name}')
    run = build.build(cfg)
    assert run.train.num_steps < arith_tiny.get_config().train.num_steps
    assert cfg.correction.mode == presets.overrides(name)['correction.mode']


def test_task_configs_are_sized_as_documented():
  small = build.build(arith_tiny.get_config())
  assert small.train.sft_steps > 0 and small.model.hf_path == ''
  qwen = build.build(gsm8k_qwen.get_config())
  assert qwen.train.sft_steps == 0 and qwen.data.source == 'jsonl'
  big = build.build(llama8b_fsdp.get_config())
  assert big.model.scan_layers and big.model.remat != 'none'


def _build_with(**overrides):
  cfg = arith_tiny.get_config()
  for path, value in overrides.items():
    section, field = path.split('__')
    cfg[section][field] = value
  return build.build(cfg)


INVALID = [
  ({'train__mini_batches': 3}, r'config\.train\.mini_batches.*divisor'),
  ({'train__micro_batches': 1000}, r'config\.train\.micro_batches'),
  ({'algorithm__estimator': 'gae'}, r'config\.critic\.enabled'),
  ({'algorithm__estimator': 'remax'}, r'config\.algorithm\.estimator'),
  ({'rollout__max_new_tokens': 64}, r'max_position_embeddings'),
  ({'rollout__mode': 'asynch'}, r"config\.rollout\.mode.*'sync'"),
  ({'rollout__simulated_quant': 'int4'}, r'config\.rollout\.simulated_quant'),
  ({'rollout__logprob_mode': 'exact'}, r'config\.rollout\.logprob_mode'),
  ({'rollout__quantization': 'int4'}, r"config\.rollout\.quantization.*'fp8'"),
  (
    {'rollout__quantization': 'int8', 'rollout__simulated_quant': 'int8'},
    r'config\.rollout\.simulated_quant',
  ),
  ({'rollout__matched_precision': True}, r"quantization='none'"),
  (
    {'rollout__engine_dtype': 'bfloat16', 'rollout__kv_cache_dtype': 'float32'},
    r'config\.rollout\.kv_cache_dtype.*no wider',
  ),
  (
    {'rollout__quantization': 'fp8', 'rollout__quantize_activations': True},
    r'config\.rollout\.quantize_activations.*fp8 matmuls',
  ),
  ({'rollout__logprob_mode': 'mask'}, r"logprob_mode.*'replay'"),
  ({'rollout__kept_set_capacity': 0}, r'config\.rollout\.kept_set_capacity'),
  ({'reward__functions': 'exact_match,nope'}, r'nope.*exact_match'),
  ({'optim__schedule': 'linear'}, r'config\.optim\.schedule'),
  ({'optim__learning_rate': -1.0}, r'config\.optim\.learning_rate'),
  ({'model__dtype': 'fp8'}, r"config\.model\.dtype.*'bfloat16'"),
  ({'model__remat': 'all'}, r'config\.model\.remat'),
  ({'data__source': 'csv'}, r"config\.data\.source.*'jsonl'"),
  ({'data__prompt_template': 'no slot'}, r'config\.data\.prompt_template'),
  ({'train__num_steps': -1}, r'config\.train\.num_steps'),
  ({'mesh__fsdp': 0}, r'config\.mesh\.fsdp'),
  ({'mesh__data': -1}, r'at most one axis'),
  ({'correction__is_level': 'word'}, r'is_level'),
  # What the packed forward does not read (docs/training.md, "Speed").
  (
    {'train__packing': True, 'rollout__logprob_mode': 'truncated'},
    r"config\.rollout\.logprob_mode: invalid value 'truncated'.*"
    r"'full' with train\.packing=True",
  ),
  (
    {
      'train__packing': True,
      'model__architecture': 'MixtralForCausalLM',
      'model__num_experts': 4,
      'model__num_experts_per_tok': 2,
    },
    r'config\.train\.packing: invalid value True.*MoE',
  ),
  # The model's own shape rules, at config time (were tracebacks when the
  # model was built).
  (
    {
      'model__architecture': 'MixtralForCausalLM',
      'model__num_experts': 4,
      'model__num_experts_per_tok': 5,
    },
    r'config\.model\.num_experts_per_tok=5 .*allowed: 1 <= '
    r'num_experts_per_tok <= 4',
  ),
  (
    {'model__architecture': 'MixtralForCausalLM', 'model__num_experts': 4},
    r'config\.model\.num_experts_per_tok=0 ',
  ),
  (
    {'model__num_experts': 4, 'model__num_experts_per_tok': 2},
    r'config\.model\.num_experts=4 needs an MoE architecture',
  ),
  # Replay on a dense model would replay nothing.
  ({'moe__router_replay': 'rollout'}, r'config\.moe\.router_replay.*dense'),
  # A block that tiles no weight's inputs was silently per channel.
  (
    {'rollout__quantization': 'int8', 'rollout__quantization_block': 7},
    r'config\.rollout\.quantization_block: invalid value 7 \(.*o_proj '
    r'contract 4 x 32.*allowed: 0 .*: 1, 2, 4, 8, 16, 32, 64, 128$',
  ),
  # Fields only mode='stream' reads: another value with another mode.
  (
    {'rollout__kv_on_update': 'recompute'},
    r"config\.rollout\.kv_on_update: invalid value 'recompute'.*allowed: "
    r"'keep' with rollout\.mode='sync'",
  ),
  (
    {
      'rollout__mode': 'async',
      'rollout__max_staleness': 1,
      'rollout__weight_sync': 'scheduled',
    },
    r"config\.rollout\.weight_sync: invalid value 'scheduled'.*allowed: "
    r"'latest' with rollout\.mode='async'",
  ),
]


@pytest.mark.parametrize(('overrides', 'match'), INVALID)
def test_invalid_values_and_combinations_fail_at_build(overrides, match):
  with pytest.raises(ValueError, match=match):
    _build_with(**overrides)


def test_stream_only_fields_take_any_value_with_stream():
  run = _build_with(
    rollout__mode='stream',
    rollout__max_staleness=1,
    rollout__weight_sync='scheduled',
    rollout__kv_on_update='recompute',
  )
  assert (run.rollout.weight_sync, run.rollout.kv_on_update) == (
    'scheduled',
    'recompute',
  )


@pytest.mark.parametrize('name', NAMES)
def test_presets_leave_the_stream_only_fields_alone(name):
  """A preset composes with every mode: it never sets a field that only
  mode='stream' accepts at another value."""
  touched = set(presets.overrides(name))
  assert not touched & {'rollout.weight_sync', 'rollout.kv_on_update'}


def test_bypass_with_micro_batches_needs_an_explicit_agg():
  # GSPO's own aggregation is per sequence, the entropy term's per token.
  cfg = arith_tiny.get_config('bypass_ppo_clip')
  cfg.train.micro_batches = 2
  cfg.actor.policy_loss = 'gspo'
  cfg.actor.agg = None
  cfg.actor.entropy_coeff = 0.01
  with pytest.raises(ValueError, match=r'config\.actor\.agg'):
    build.build(cfg)
  cfg.actor.agg = 'token_mean'
  build.build(cfg)


def test_trainer_fields_are_documented():
  """Each trainer field carries its doc, declared once on its dataclass,
  and configs/trainer.py's sections are exactly those fields."""
  n = 0
  for name, cls in build.SECTIONS.items():
    docs = fields.docs(cls)
    assert set(docs) == set(base.base_config()[name]), name
    for field, doc in docs.items():
      n += 1
      assert len(doc) > 10, f'{name}.{field}'
  assert n > 70  # every section was seen


def _main(tmp_path, *args):
  return subprocess.run(
    [sys.executable, '-m', 'jaxcorr.main', f'--workdir={tmp_path}/w', *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )


def test_cli_typo_and_bad_value_fail_before_any_work(tmp_path):
  typo = _main(tmp_path, '--config.train.num_step=5')
  assert typo.returncode != 0
  assert 'num_step' in typo.stderr
  bad = _main(tmp_path, '--config.rollout.mode=asynch')
  assert bad.returncode != 0
  assert "config.rollout.mode: invalid value 'asynch'" in bad.stderr
  assert 'Traceback' not in bad.stderr  # a usage error, not a crash
  assert not (tmp_path / 'w').exists()  # nothing written
  unknown = _main(tmp_path, '--config=configs/arith_tiny.py:decoupled_tis')
  assert unknown.returncode != 0
  assert 'decoupled_token_is' in unknown.stderr  # the suggestion


def test_building_a_config_imports_no_engine():
  """Building a config (every CLI does, before anything else) loads neither
  JetStream nor TensorFlow: TensorFlow's CUDA probe can print after the
  engine's quiet import wrapper returns, a line the planner's and the
  CLIs' one-line errors would carry (a fresh process)."""
  code = (
    'import sys\n'
    'from jaxcorr.train import build\n'
    'from configs import arith_opd_tiny, arith_tiny\n'
    'build.build(arith_tiny.get_config())\n'
    'build.build(arith_opd_tiny.get_config("opd_topk"))\n'
    "print(sorted(m for m in ('tensorflow', 'jetstream', 'seqio') "
    'if m in sys.modules))\n'
  )
  out = subprocess.run(
    [sys.executable, '-c', code],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=True,
  )
  assert out.stdout.split('\n')[-2] == '[]', out.stderr[-2000:]
