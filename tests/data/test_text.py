"""The byte vocabulary of a model from scratch (`config.data.tokenizer=
'bytes'`), its config-time rules, and what the start-up prompt check
advises for text a vocabulary cannot encode."""

from __future__ import annotations

import pytest

from configs import arith_tiny, rg_tiny
from jaxcorr.data import prompt_check, tasks, text
from jaxcorr.data.reasoning_gym import ReasoningGymSource
from jaxcorr.train import build
from jaxcorr.train.policy import transformer_config


@pytest.mark.parametrize(
  's', ['', '17+25=', 'State the answer: 4 - 1 =', 'héllo\n→ 😀', '\x00\xff']
)
def test_bytes_round_trip_any_text(s):
  tok = text.ByteTokenizer()
  ids = tok.encode(s, eos=True)
  assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
  assert len(ids) == len(s.encode('utf-8')) + 2
  assert all(0 <= i < tok.vocab_size for i in ids)
  assert tok.decode(ids) == s
  assert tok.encode(s, bos=False) == ids[1:-1]


def test_bytes_specials_are_the_character_vocabulary_s():
  byte, char = text.ByteTokenizer(), tasks.CharTokenizer()
  assert byte.vocab_size == 259
  for attr in ('pad_id', 'bos_id', 'eos_id', 'stop_ids'):
    assert getattr(byte, attr) == getattr(char, attr), attr
  # Decoding stops at EOS, skips PAD/BOS; a split character is U+FFFD.
  e_acute = list('é'.encode())
  ids = [1, 0, e_acute[0] + 3, ord('a') + 3, 2, ord('b') + 3]
  assert byte.decode(ids) == '\ufffda'
  # An id past the vocabulary (vocab_size 320 > 259 embedding rows).
  assert byte.decode([ord('7') + 3, 300]) == '7\ufffd'


def test_make_tokenizer_picks_the_vocabulary():
  run = build.build(rg_tiny.get_config('pulse'))
  assert run.data.tokenizer == 'bytes' and run.model.vocab_size == 259
  model = transformer_config(run.model)
  tok = text.make_tokenizer('', model, run.data.tokenizer)
  assert isinstance(tok, text.ByteTokenizer)
  assert isinstance(text.make_tokenizer('', model), tasks.CharTokenizer)


@pytest.mark.parametrize(
  'overrides, match',
  [
    ({'data.tokenizer': 'words'}, r"config\.data\.tokenizer.*'chars', 'bytes'"),
    ({'data.tokenizer': 'bytes'}, r'config\.model\.vocab_size: .* >= 259'),
    (
      {'data.tokenizer': 'bytes', 'model.hf_path': '/models/x'},
      r"config\.data\.tokenizer: invalid value 'bytes'.*tokenizer\.json",
    ),
  ],
)
def test_tokenizer_rules_at_config_time(overrides, match):
  c = arith_tiny.get_config('pulse')
  for path, value in overrides.items():
    section, field = path.split('.')
    c[section][field] = value
  with pytest.raises(ValueError, match=match):
    build.build(c)


def test_unencodable_prompts_advise_the_byte_vocabulary():
  """reasoning-gym on the character vocabulary used to fail with 'raise
  the limit' (max_prompt_length), whatever the limit: the fix is the
  vocabulary. The byte vocabulary encodes every row."""
  src = ReasoningGymSource('chain_sum', '', 0, 4)
  kw = dict(template='{prompt}', max_prompt_length=512)
  with pytest.raises(prompt_check.PromptError) as info:
    prompt_check.check_prompts(src, tasks.CharTokenizer().encode, **kw)
  msg = str(info.value)
  assert msg.startswith('4 prompt(s) cannot be used: 4 that the tokenizer ')
  assert "config.data.tokenizer='bytes'" in msg
  assert 'max_prompt_length' not in msg
  prompt_check.check_prompts(src, text.ByteTokenizer().encode, **kw)
