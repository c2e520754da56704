"""The Flax NNX policy model: Llama 3 / Qwen2 / Qwen3 decoder, HF checkpoint
I/O and chunked per-token log-probs.

Layout: `config` (TransformerConfig), `layers` (norm, RoPE, attention, MLP),
`transformer` (the module, KV cache), `logprobs` (token_logprobs),
`hf_io` (load_hf / save_hf / load_tokenizer).
"""

from jaxcorr.model.config import (
  RopeScaling,
  TransformerConfig,
  UnsupportedModelError,
)
from jaxcorr.model.hf_io import (
  WeightsMismatchError,
  load_hf,
  load_tokenizer,
  save_hf,
)
from jaxcorr.model.logprobs import (
  REMAT_MODES,
  logprobs_from_hidden,
  naive_token_logprobs,
  token_logprobs,
)
from jaxcorr.model.transformer import KVCache, Transformer, segment_positions

__all__ = [
  'REMAT_MODES',
  'KVCache',
  'RopeScaling',
  'Transformer',
  'TransformerConfig',
  'UnsupportedModelError',
  'WeightsMismatchError',
  'load_hf',
  'load_tokenizer',
  'logprobs_from_hidden',
  'naive_token_logprobs',
  'save_hf',
  'segment_positions',
  'token_logprobs',
]
