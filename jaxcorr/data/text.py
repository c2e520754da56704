"""Text <-> token ids for the trainer: prompts in, responses out.

The trainer tokenises each prompt once and never re-tokenises a response
(docs/math/rollout_contract.md §3): the engine's ids go straight into the
training batch; text is decoded only for the reward functions. Three
tokenizers share one small interface (`encode(text, bos=...)`, `decode(ids)`,
`vocab_size`, `eos_id`; `stop_ids(tokenizer)` adds the model's other stop
tokens):

* `jaxcorr.data.tasks.CharTokenizer` for the embedded arithmetic task
  (`config.data.tokenizer='chars'`, the default of a model from scratch);
* `ByteTokenizer`, any UTF-8 text, for a model from scratch on other text
  (`config.data.tokenizer='bytes'`: reasoning-gym questions, an
  environment's observations);
* `HFTextTokenizer`, a `tokenizers.Tokenizer` from a local HF checkpoint
  (`tokenizer.json`), for real models.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxcorr.config import fields
from jaxcorr.data.config import TOKENIZERS
from jaxcorr.model import TransformerConfig, load_tokenizer

_SPECIALS = 3  # PAD, BOS, EOS: ids 0-2 of both vocabularies from scratch


class ByteTokenizer:
  """UTF-8 bytes: 0 = PAD, 1 = BOS, 2 = EOS, byte b = id b + 3 (259 ids).

  Why bytes and not a small BPE trained at start-up on the task's text:
  the ids are fixed in code, so a checkpoint never depends on a vocabulary
  file or on the data it was trained on (a BPE learnt from the prompts
  would give other ids for another data seed, eval set or environment, and
  a resumed or evaluated run would have to rebuild it exactly); every
  string encodes, so no prompt, template or observation is refused; and
  259 embedding rows cost a tiny model little (33k parameters at hidden
  size 128). The price is length: one token per byte, about 4x a BPE's
  count on English, which short tasks (a 67-byte reasoning-gym question)
  afford. The special ids are `CharTokenizer`'s, so code that reads them
  (export's model config) sees the same ids for either vocabulary.
  """

  vocab_size = 256 + _SPECIALS
  pad_id, bos_id, eos_id = 0, 1, 2
  stop_ids = (eos_id,)

  def encode(
    self, text: str, *, bos: bool = True, eos: bool = False
  ) -> list[int]:
    """Text -> ids (its UTF-8 bytes), BOS first (`bos`), EOS last (`eos`)."""
    ids = [b + _SPECIALS for b in text.encode('utf-8')]
    return [self.bos_id] * bos + ids + [self.eos_id] * eos

  def decode(self, ids: Sequence[int]) -> str:
    """Ids -> text: stops at the first EOS, skips PAD and BOS; bytes that
    are not UTF-8 (a sampled id may split a character) and ids past the
    vocabulary (a model with more embedding rows) decode to U+FFFD, which
    never matches an answer."""
    out = bytearray()
    for raw in ids:
      i = int(raw)
      if i == self.eos_id:
        break
      if i >= _SPECIALS:
        # 0xFF is never UTF-8: it decodes to U+FFFD.
        out.append(i - _SPECIALS if i < self.vocab_size else 0xFF)
    return out.decode('utf-8', errors='replace')


class HFTextTokenizer:
  """A HF `tokenizers.Tokenizer` with the model's BOS/EOS conventions."""

  def __init__(self, tokenizer: Any, config: TransformerConfig):
    self._tok = tokenizer
    self.vocab_size = tokenizer.get_vocab_size()
    eos = config.eos_token_id
    if eos is None:
      raise ValueError(
        'the HF config has no eos_token_id: the trainer needs a stop token'
      )
    self.stop_ids = tuple(eos) if isinstance(eos, tuple) else (int(eos),)
    self.eos_id = self.stop_ids[0]
    self.bos_id = config.bos_token_id
    self.pad_id = config.pad_token_id if config.pad_token_id is not None else 0

  def encode(self, text: str, *, bos: bool = True) -> list[int]:
    # add_special_tokens=False: templates carry their own special tokens;
    # BOS is prepended explicitly for models that have one (Llama).
    ids = self._tok.encode(text, add_special_tokens=False).ids
    # A chat template that writes the BOS itself (SmolLM2's <|im_start|>)
    # must not get a second one: transformers' apply_chat_template adds none.
    if bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
      ids = [self.bos_id, *ids]
    return list(ids)

  def decode(self, ids: Sequence[int]) -> str:
    out = []
    for i in ids:
      if int(i) in self.stop_ids:
        break
      out.append(int(i))
    return self._tok.decode(out, skip_special_tokens=True)


def scratch_tokenizer(kind: str = 'chars') -> Any:
  """The tokenizer of a model from scratch: `CharTokenizer` ('chars') or
  `ByteTokenizer` ('bytes'), `config.data.tokenizer`."""
  if kind == 'bytes':
    return ByteTokenizer()
  if kind != 'chars':
    fields.fail('config.data.tokenizer', kind, ', '.join(map(repr, TOKENIZERS)))
  from jaxcorr.data.tasks import CharTokenizer

  return CharTokenizer()


def check_tokenizer(kind: str, hf_path: str, vocab_size: int) -> None:
  """Config-time rules of `config.data.tokenizer`: a HF checkpoint brings
  its own tokenizer ('bytes' would be ignored), and a model from scratch
  embeds every id of its vocabulary (`config.model.vocab_size`)."""
  if hf_path and kind != 'chars':
    fields.fail(
      'config.data.tokenizer',
      kind,
      "'chars' (the default) with config.model.hf_path",
      "the checkpoint's tokenizer.json is used",
    )
  need = 0 if hf_path else scratch_tokenizer(kind).vocab_size
  if vocab_size < need:
    fields.fail(
      'config.model.vocab_size',
      vocab_size,
      f'>= {need} (the ids of data.tokenizer={kind!r})',
    )


def make_tokenizer(
  hf_path: str, config: TransformerConfig, kind: str = 'chars'
) -> Any:
  """`HFTextTokenizer` of `hf_path`, or the `scratch_tokenizer` of `kind`;
  ValueError when its vocabulary has ids the model cannot embed."""
  if hf_path:
    tokenizer = HFTextTokenizer(load_tokenizer(hf_path), config)
  else:
    tokenizer = scratch_tokenizer(kind)
  if tokenizer.vocab_size > config.vocab_size:
    raise ValueError(
      f'config.model.vocab_size={config.vocab_size} is smaller than the '
      f'tokenizer vocabulary ({tokenizer.vocab_size})'
    )
  return tokenizer


def stop_ids(tokenizer: Any) -> tuple[int, ...]:
  """Token ids that end a response (EOS and the model's other stops)."""
  return tuple(getattr(tokenizer, 'stop_ids', (tokenizer.eos_id,)))
