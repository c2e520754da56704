"""A real `tokenizers` tokenizer with chat special tokens, built in memory
(no download), and a ChatML template over it: the setting where
re-tokenizing a conversation could change ids (tests/agents/)."""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from jaxcorr.data.text import HFTextTokenizer
from tests.helpers.model_testing import tiny_config

SPECIALS = ('<|endoftext|>', '<|im_start|>', '<|im_end|>')
CHARS = string.ascii_letters + string.digits + string.punctuation + ' \n'

CHATML = (
  '{% for m in messages %}'
  "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
  '{% endfor %}'
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""SmolLM2's turn layout (without its default system message)."""


def chat_tokenizer() -> tuple[HFTextTokenizer, int]:
  """(an `HFTextTokenizer` with one id per character and the ChatML
  special tokens, its vocabulary size). EOS = '<|im_end|>'."""
  vocab = {tok: i for i, tok in enumerate(SPECIALS)}
  vocab.update({c: len(SPECIALS) + i for i, c in enumerate(CHARS)})
  tok = Tokenizer(models.WordLevel(vocab, unk_token='<|endoftext|>'))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex(r'[\s\S]'), 'isolated')
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens(list(SPECIALS))
  cfg = tiny_config(
    vocab_size=len(vocab), eos_token_id=vocab['<|im_end|>'], bos_token_id=None
  )
  return HFTextTokenizer(tok, cfg), len(vocab)
