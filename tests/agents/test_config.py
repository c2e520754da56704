"""`config.agent`: off by default, and the combinations multi-turn
rollouts do not support fail at build time naming the config path."""

import pytest

from configs import arith_tiny, arith_tool
from jaxcorr.agents.config import AgentConfig
from jaxcorr.agents.episodes import engine_headroom, engine_prefill
from jaxcorr.train.build import build


def test_off_by_default():
  run = build(arith_tiny.get_config('pulse'))
  assert not run.agent.enabled
  assert build(arith_tool.get_config('pulse')).agent.enabled


@pytest.mark.parametrize(
  'section, field, value, message',
  [
    ('rollout', 'logprob_mode', 'replay', 'config.rollout.logprob_mode'),
    ('agent', 'environment', 'nope', 'config.agent.environment'),
    ('agent', 'user_content', 'no field', 'config.agent.user_content'),
    ('agent', 'call_body', 'xml', 'config.agent.call_body'),
    ('rollout', 'kv_cache_dtype', 'int8', 'config.rollout.kv_cache_dtype'),
  ],
)
def test_unsupported_combinations_fail(section, field, value, message):
  c = arith_tool.get_config('pulse')
  c[section][field] = value
  with pytest.raises(ValueError, match=message):
    build(c)


@pytest.mark.parametrize('mode', ['async', 'stream'])
def test_every_rollout_mode_builds(mode):
  c = arith_tool.get_config('pulse')
  c.rollout.mode, c.rollout.max_staleness = mode, 1
  assert build(c).rollout.mode == mode


def test_an_moe_policy_is_refused():
  c = arith_tool.get_config('pulse')
  c.model.architecture = 'MixtralForCausalLM'
  c.model.num_experts = 4
  c.model.num_experts_per_tok = 2
  with pytest.raises(ValueError, match=r'config\.agent\.environment'):
    build(c)


def test_dataclass_defaults():
  cfg = AgentConfig()
  assert cfg.environment == '' and cfg.kv_reuse and not cfg.drop_truncated


def test_engine_sizes():
  off, on = AgentConfig(), AgentConfig(environment='calculator')
  assert engine_headroom(off) == 0 and engine_prefill(off, 8, 5) == 8
  assert engine_headroom(on) == 65  # max_env_tokens + 1: the top bucket
  assert engine_prefill(on, 8, 5) == 8
  again = AgentConfig(environment='calculator', kv_reuse=False)
  assert engine_headroom(again) == 0 and engine_prefill(again, 8, 5) == 13


@pytest.mark.parametrize(
  'changes, message',
  [
    (
      {'chat_template': 'model'},
      r"^config\.agent\.chat_template: invalid value 'model' .*; allowed: "
      r"'arith' without config\.model\.hf_path$",
    ),
    (
      {'call_body': 'json'},
      r"^config\.agent\.call_body: invalid value 'json' \(the tokenizer "
      r"cannot write .*'\{'.*\); allowed: 'text'",
    ),
    (
      {'call_body': 'text', 'call_start': '<tool_call>'},
      r"^config\.agent\.call_start: invalid value '<tool_call>' \(the "
      r"tokenizer cannot write '<' .*\); allowed: a tag of characters",
    ),
  ],
)
def test_what_a_model_from_scratch_cannot_do_fails_at_config_time(
  changes, message
):
  """A model from scratch has no chat template of its own, and the
  character vocabulary cannot write a JSON call (braces, quotes, the
  tool's name) or the Hermes tags: one line each, before any work."""
  c = arith_tool.get_config('pulse')
  c.agent.update(changes)
  with pytest.raises(ValueError, match=message) as err:
    build(c)
  assert '\n' not in str(err.value)


def test_a_byte_vocabulary_writes_json_calls():
  c = arith_tool.get_config('pulse')
  c.data.tokenizer, c.model.vocab_size = 'bytes', 259
  c.agent.update(
    call_body='json', call_start='<tool_call>', call_end='</tool_call>'
  )
  assert build(c).agent.call_body == 'json'
