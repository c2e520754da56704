"""The tiny engine the multi-turn tests share (tests/agents/conftest.py
builds it once): a random model over a tokenizer with ChatML special
tokens, its turn format and its compiled `Continuation`."""

from __future__ import annotations

from jaxcorr.agents.continuation import Continuation, cache_headroom
from jaxcorr.agents.turns import TurnFormat
from jaxcorr.data.chat import ChatTemplate
from jaxcorr.rollout.engine import PolicyEngine
from tests.helpers.chat_tokenizer import CHATML, chat_tokenizer
from tests.helpers.model_testing import random_model, tiny_config

P, T, SLOTS = 48, 80, 4  # P + T: a power of two (few prefill buckets)


def build():
  """(tokenizer, model, engine, turn format, continuation)."""
  tok, vocab = chat_tokenizer()
  model = random_model(
    tiny_config(
      vocab_size=vocab,
      hidden_size=32,
      intermediate_size=64,
      num_heads=2,
      num_kv_heads=1,
      max_position_embeddings=512,
    )
  )
  target = P + T + cache_headroom(64 + 1)  # TurnLimits.env_tokens
  engine = PolicyEngine(
    model,
    max_concurrent_decodes=SLOTS,
    max_prefill_length=P + T,  # the re-prefill baseline's histories
    max_target_length=target,
    decode_chunk=8,
    min_attend_bucket=target,  # one attention bucket: few compilations
  )
  turns = TurnFormat(ChatTemplate(CHATML), tok)
  return tok, model, engine, turns, Continuation(engine)
