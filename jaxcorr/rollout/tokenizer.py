"""`IdTokenizer`: a JetStream tokenizer whose text is the token ids
  themselves ("12 7 99"), for tiny random models that have no vocabulary
  file. RL prompts travel as ids anyway (`docs/math/rollout_contract.md` §3);
  this only lets JetStream's text-based server and client talk to such a model.
  It decodes each id as a space and the id (" 12 7 99" for three ids):
  JetStream's server streams one decoded id per piece and its clients join
  the pieces, which then still read back as whitespace-separated ids, and
  the prompt's text followed by the response's is the whole sequence.
(Chat templates, a text concern of the trainer, are in
jaxcorr/data/chat.py.)
"""

from __future__ import annotations

import numpy as np

from jaxcorr.rollout.tf_startup import quiet_tensorflow_startup

with quiet_tensorflow_startup():  # JetStream's token_utils imports TensorFlow
  from jetstream.engine import token_utils, tokenizer_api


class IdTokenizer(tokenizer_api.Tokenizer):
  """Whitespace-separated decimal ids <-> int32 arrays."""

  def __init__(self, vocab_size: int, *, eos_id: int = 1, pad_id: int = 0):
    self.vocab_size = vocab_size
    self._eos, self._pad = eos_id, pad_id

  def encode(
    self,
    s: str,
    *,
    is_bos: bool = False,
    max_prefill_length: int | None = None,
    jax_padding: bool = True,
    **kwargs,
  ) -> tuple[np.ndarray, int]:
    """Text of ids -> (ids, length); with `max_prefill_length` (how the
    JetStream orchestrator calls it) right-padded to JetStream's buckets."""
    del kwargs
    try:
      ids = np.asarray([int(w) for w in s.split()], np.int32)
    except ValueError as err:
      raise ValueError(
        f'expected whitespace-separated token ids: {s!r}'
      ) from err
    if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
      raise ValueError(f'token ids must lie in [0, {self.vocab_size}): {s!r}')
    if max_prefill_length is None:
      return ids, int(ids.size)
    return token_utils.pad_tokens(
      ids,
      self.bos_id,
      self.pad_id,
      is_bos=is_bos,
      max_prefill_length=max_prefill_length,
      jax_padding=jax_padding,
    )

  def decode(self, token_ids: list[int], **kwargs) -> str:
    """' <id>' per id (module doc): decoding piece by piece and joining
    equals decoding the whole list."""
    del kwargs
    return ''.join(f' {int(t)}' for t in token_ids)

  @property
  def pad_id(self) -> int:
    return self._pad

  @property
  def eos_id(self) -> int:
    return self._eos

  @property
  def bos_id(self) -> int:
    return self._eos

  @property
  def stop_tokens(self) -> set[int]:
    return {self._eos}
