"""Text <-> token ids for the trainer: prompts in, responses out.

The trainer tokenises each prompt once and never re-tokenises a response
(docs/math/rollout_contract.md §3): the engine's ids go straight into the
training batch; text is decoded only for the reward functions. Two tokenizers
share one small interface (`encode(text, bos=...)`, `decode(ids)`, `vocab_size`,
`eos_id`; `stop_ids(tokenizer)` adds the model's other stop tokens):

* `jaxcorr.data.tasks.CharTokenizer` for the embedded arithmetic task;
* `HFTextTokenizer`, a `tokenizers.Tokenizer` from a local HF checkpoint
  (`tokenizer.json`), for real models.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxcorr.model import TransformerConfig, load_tokenizer


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


def make_tokenizer(hf_path: str, config: TransformerConfig) -> Any:
  """`HFTextTokenizer` of `hf_path`, or the arithmetic `CharTokenizer`;
  ValueError when its vocabulary has ids the model cannot embed."""
  if hf_path:
    tokenizer = HFTextTokenizer(load_tokenizer(hf_path), config)
  else:
    from jaxcorr.data.tasks import CharTokenizer

    tokenizer = CharTokenizer()
  if tokenizer.vocab_size > config.vocab_size:
    raise ValueError(
      f'config.model.vocab_size={config.vocab_size} is smaller than the '
      f'tokenizer vocabulary ({tokenizer.vocab_size})'
    )
  return tokenizer


def stop_ids(tokenizer: Any) -> tuple[int, ...]:
  """Token ids that end a response (EOS and the model's other stops)."""
  return tuple(getattr(tokenizer, 'stop_ids', (tokenizer.eos_id,)))
