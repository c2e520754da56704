"""GGUF (llama.cpp) files -> Hugging Face checkpoint directories.

`convert_gguf(path, out)` writes config.json, model.safetensors,
tokenizer.json, tokenizer_config.json (with the file's chat template),
special_tokens_map.json and generation_config.json, which `load_hf` and
`transformers` both load. Llama-architecture files with a byte-level BPE
vocabulary only (SmolLM2, Llama-3-style models); anything else is an
`UnsupportedModelError` naming what is supported.

Weights: each tensor is dequantized with the `gguf` package
(`gguf.quants.dequantize`) to float32, one tensor at a time. For Q4_1 a
block of 32 weights stores a float16 scale d, a float16 minimum m and 32
4-bit codes q, and w = d * q + m; Q8_0 stores d and int8 q, w = d * q.
Float32 holds every such product exactly enough that the dequantized
weights *are* the model (`docs/smollm2.md` measures them against
transformers' own GGUF loader).

Two llama.cpp conventions are undone here:

* Q/K rows: llama.cpp's converter permutes the rows of `attn_q` / `attn_k`
  within each head from HF's half-split RoPE layout ([d/2 | d/2]) to the
  interleaved one ((x0, x1), (x2, x3), ...). `_unpermute` restores HF's.
* Tied embeddings: a file without `output.weight` reuses `token_embd` as the
  output layer, i.e. `tie_word_embeddings=True`.

A file cut short (an interrupted download or copy) is a `TruncatedGGUFError`
before anything is read or written: `check_complete` walks the header and
compares each tensor's extent with the file size, and the error names the
file, the first tensor cut (or the header field the file ends in) and the
bytes missing.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxcorr.model.config import UnsupportedModelError

# GGUF tensor name -> HF name ('{}' is the layer index).
_GLOBAL = {
  'token_embd.weight': 'model.embed_tokens.weight',
  'output_norm.weight': 'model.norm.weight',
  'output.weight': 'lm_head.weight',
}
_LAYER = {
  'attn_norm.weight': 'input_layernorm.weight',
  'attn_q.weight': 'self_attn.q_proj.weight',
  'attn_k.weight': 'self_attn.k_proj.weight',
  'attn_v.weight': 'self_attn.v_proj.weight',
  'attn_output.weight': 'self_attn.o_proj.weight',
  'ffn_norm.weight': 'post_attention_layernorm.weight',
  'ffn_gate.weight': 'mlp.gate_proj.weight',
  'ffn_up.weight': 'mlp.up_proj.weight',
  'ffn_down.weight': 'mlp.down_proj.weight',
}
# tokenizer.ggml.pre -> whether digits are split one by one before the
# byte-level regex (llama.cpp's 'smollm' pre-tokenizer: '\p{N}' first, then
# GPT-2's regex; the HF original is Digits(individual) + ByteLevel).
_PRE_TOKENIZERS = {'default': False, 'gpt2': False, 'smollm': True}
# llama.cpp token types: 1 normal, 3 control (special), 4 user-defined.
_CONTROL = 3
# GGUF metadata value types (gguf.GGUFValueType) with a fixed size -> struct
# format; 8 is a string, 9 an array.
_SCALARS = {
  0: 'B', 1: 'b', 2: 'H', 3: 'h', 4: 'I', 5: 'i', 6: 'f', 7: '?',
  10: 'Q', 11: 'q', 12: 'd',
}  # fmt: skip
_STRING, _ARRAY = 8, 9


class TruncatedGGUFError(ValueError):
  """The GGUF file ends before its header or a tensor it describes does."""


class _HeaderReader:
  """Sequential little-endian reads of a GGUF header; the file ending inside
  one is a `TruncatedGGUFError` saying which field."""

  def __init__(self, fh, path: str, size: int):
    self.fh, self.path, self.size = fh, path, size

  def _short(self, n: int, what: str) -> TruncatedGGUFError:
    missing = self.fh.tell() + n - self.size
    return TruncatedGGUFError(
      f'{self.path}: truncated GGUF file: it ends at byte {self.size}, inside '
      f'its header ({what}); at least {missing} bytes missing'
    )

  def read(self, fmt: str, what: str) -> tuple:
    n = struct.calcsize('<' + fmt)
    if self.fh.tell() + n > self.size:
      raise self._short(n, what)
    return struct.unpack('<' + fmt, self.fh.read(n))

  def skip(self, n: int, what: str) -> None:
    if self.fh.tell() + n > self.size:
      raise self._short(n, what)
    self.fh.seek(n, os.SEEK_CUR)

  def string(self, what: str) -> str:
    (n,) = self.read('Q', what)
    if self.fh.tell() + n > self.size:
      raise self._short(n, what)
    return self.fh.read(n).decode('utf-8', errors='replace')

  def value(self, vtype: int, what: str) -> Any:
    """One metadata value; arrays are skipped (None)."""
    if vtype == _STRING:
      return self.string(what)
    if vtype in _SCALARS:
      return self.read(_SCALARS[vtype], what)[0]
    if vtype != _ARRAY:
      raise ValueError(f'{self.path}: unknown GGUF value type {vtype} ({what})')
    item, count = self.read('IQ', what)
    if item in _SCALARS:
      self.skip(count * struct.calcsize('<' + _SCALARS[item]), what)
    else:
      for _ in range(count):
        self.value(item, what)
    return None


def check_complete(path: str) -> None:
  """Raise `TruncatedGGUFError` when the file `path` ends before its header
  or before the last byte of any tensor the header describes; returns when
  the file holds them all. Not a GGUF file: `UnsupportedModelError`. Tensor
  types this `gguf` package does not know are left to `gguf.GGUFReader`."""
  import gguf

  size = os.path.getsize(path)
  with open(path, 'rb') as fh:
    h = _HeaderReader(fh, path, size)
    (magic,) = h.read('I', 'magic')
    if magic != gguf.GGUF_MAGIC:
      raise UnsupportedModelError(
        f'{path}: not a GGUF file (no GGUF magic number); supported: GGUF'
      )
    (version,) = h.read('I', 'version')
    if version & 0xFFFF == 0:
      return  # a big-endian file: GGUFReader handles (and checks) those
    n_tensors, n_kv = h.read('QQ', 'tensor and metadata counts')
    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
    for i in range(n_kv):
      key = h.string(f'metadata key {i} of {n_kv}')
      (vtype,) = h.read('I', f'metadata {key!r}')
      value = h.value(vtype, f'metadata {key!r}')
      if key == 'general.alignment' and isinstance(value, int) and value > 0:
        alignment = value
    infos = []
    for i in range(n_tensors):
      name = h.string(f'tensor info {i} of {n_tensors}')
      (n_dims,) = h.read('I', f'tensor info {name!r}')
      dims = h.read(f'{n_dims}Q', f'tensor info {name!r}')
      ttype, offset = h.read('IQ', f'tensor info {name!r}')
      infos.append((name, dims, ttype, offset))
    data_start = -(-fh.tell() // alignment) * alignment
  extents = []
  for name, dims, ttype, offset in infos:
    try:
      block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
    except (KeyError, ValueError):
      return
    start = data_start + offset
    extents.append((start, start + math.prod(dims) // block * type_size, name))
  cut = sorted(e for e in extents if e[1] > size)
  if cut:
    start, end, name = cut[0]
    total = max(e[1] for e in extents)
    raise TruncatedGGUFError(
      f'{path}: truncated GGUF file: tensor {name!r} needs bytes '
      f'{start}..{end} but the file ends at byte {size}; {total - size} bytes '
      f'missing (the complete file has at least {total} bytes)'
    )


class GGUFFile:
  """Metadata and tensors of a GGUF file (read lazily via np.memmap)."""

  def __init__(self, path: str | os.PathLike):
    import gguf  # only conversion needs it

    self.path = os.fspath(path)
    if not os.path.isfile(self.path):
      raise FileNotFoundError(f'no GGUF file {self.path!r}')
    check_complete(self.path)
    self._gguf = gguf
    self._reader = gguf.GGUFReader(self.path)
    self.meta = {
      k: f.contents()
      for k, f in self._reader.fields.items()
      if not k.startswith('GGUF.')
    }
    self.arch = self.meta.get('general.architecture')
    if self.arch != 'llama':
      raise UnsupportedModelError(
        f"{self.path}: general.architecture={self.arch!r}; supported: 'llama'"
      )

  def get(self, key: str, default: Any = None) -> Any:
    """Metadata `key`; a '{arch}.' prefix is filled in."""
    return self.meta.get(key.format(arch=self.arch), default)

  def require(self, key: str) -> Any:
    value = self.get(key)
    if value is None:
      raise UnsupportedModelError(
        f'{self.path}: missing metadata {key.format(arch=self.arch)!r}'
      )
    return value

  @property
  def tensor_names(self) -> list[str]:
    return [t.name for t in self._reader.tensors]

  def tensors(self) -> Iterator[tuple[str, str, np.ndarray]]:
    """(GGUF name, GGUF type name, float32 array in HF [out, in] layout),
    one dequantized tensor at a time."""
    for t in self._reader.tensors:
      x = self._gguf.quants.dequantize(t.data, t.tensor_type)
      shape = tuple(int(n) for n in reversed(t.shape))
      yield t.name, t.tensor_type.name, x.astype(np.float32).reshape(shape)


def hf_config(f: GGUFFile) -> dict[str, Any]:
  """The `LlamaForCausalLM` config.json dict of a llama GGUF file."""
  hidden = int(f.require('{arch}.embedding_length'))
  heads = int(f.require('{arch}.attention.head_count'))
  head_dim = int(f.get('{arch}.rope.dimension_count', hidden // heads))
  if f.get('{arch}.rope.scaling.type') not in (None, 'none'):
    raise UnsupportedModelError(
      f'{f.path}: RoPE scaling {f.get("{arch}.rope.scaling.type")!r} is not '
      'converted; supported: none'
    )
  vocab = f.get('{arch}.vocab_size') or len(f.require('tokenizer.ggml.tokens'))
  theta = float(f.get('{arch}.rope.freq_base', 10_000.0))
  eps = float(f.require('{arch}.attention.layer_norm_rms_epsilon'))
  eos = f.get('tokenizer.ggml.eos_token_id')
  return dict(
    architectures=['LlamaForCausalLM'],
    model_type='llama',
    vocab_size=int(vocab),
    hidden_size=hidden,
    intermediate_size=int(f.require('{arch}.feed_forward_length')),
    num_hidden_layers=int(f.require('{arch}.block_count')),
    num_attention_heads=heads,
    num_key_value_heads=int(f.get('{arch}.attention.head_count_kv', heads)),
    head_dim=head_dim,
    hidden_act='silu',
    # The file stores float32: 1e-5 reads back as 9.99999974e-06.
    rms_norm_eps=float(f'{eps:.7g}'),
    rope_theta=theta,
    rope_scaling=None,
    rope_parameters={'rope_type': 'default', 'rope_theta': theta},
    max_position_embeddings=int(f.get('{arch}.context_length', 2048)),
    tie_word_embeddings='output.weight' not in f.tensor_names,
    attention_bias=False,
    mlp_bias=False,
    bos_token_id=f.get('tokenizer.ggml.bos_token_id'),
    eos_token_id=eos,
    pad_token_id=f.get('tokenizer.ggml.padding_token_id'),
    torch_dtype='float32',
    dtype='float32',
    use_cache=True,
  )


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undo llama.cpp's per-head interleaving of Q/K rows (module doc)."""
  out, n_in = w.shape
  half = out // n_heads // 2
  return w.reshape(n_heads, half, 2, n_in).swapaxes(1, 2).reshape(out, n_in)


def hf_tensors(
  f: GGUFFile, config: dict[str, Any]
) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, float32 array) for every tensor of the file."""
  for name, _, x in f.tensors():
    if name in _GLOBAL:
      yield _GLOBAL[name], x
      continue
    parts = name.split('.', 2)
    if len(parts) != 3 or parts[0] != 'blk' or parts[2] not in _LAYER:
      raise UnsupportedModelError(
        f'{f.path}: tensor {name!r} has no Llama equivalent; supported: '
        f'{sorted(_GLOBAL)} and blk.N.{{{",".join(sorted(_LAYER))}}}'
      )
    if parts[2] == 'attn_q.weight':
      x = _unpermute(x, config['num_attention_heads'])
    elif parts[2] == 'attn_k.weight':
      x = _unpermute(x, config['num_key_value_heads'])
    yield f'model.layers.{parts[1]}.{_LAYER[parts[2]]}', x


# --------------------------------------------------------------- tokenizer


def build_tokenizer(f: GGUFFile):
  """A `tokenizers.Tokenizer` equal to the file's byte-level BPE vocabulary
  with llama.cpp's pre-tokenizer for `tokenizer.ggml.pre`."""
  from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
  )

  kind = f.get('tokenizer.ggml.model')
  if kind != 'gpt2':
    raise UnsupportedModelError(
      f"{f.path}: tokenizer.ggml.model={kind!r}; supported: 'gpt2' "
      '(byte-level BPE)'
    )
  pre = f.get('tokenizer.ggml.pre', 'default')
  if pre not in _PRE_TOKENIZERS:
    raise UnsupportedModelError(
      f'{f.path}: tokenizer.ggml.pre={pre!r}; supported: '
      f'{", ".join(repr(p) for p in _PRE_TOKENIZERS)}'
    )
  tokens = list(f.require('tokenizer.ggml.tokens'))
  types = list(f.get('tokenizer.ggml.token_type', [1] * len(tokens)))
  merges = [tuple(m.split(' ', 1)) for m in f.require('tokenizer.ggml.merges')]
  vocab = {t: i for i, t in enumerate(tokens)}
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if _PRE_TOKENIZERS[pre]:
    tok.pre_tokenizer = pre_tokenizers.Sequence(
      [pre_tokenizers.Digits(individual_digits=True), byte_level]
    )
  else:
    tok.pre_tokenizer = byte_level
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  tok.add_special_tokens(
    [
      AddedToken(t, special=True, normalized=False)
      for t, ty in zip(tokens, types)
      if ty == _CONTROL
    ]
  )
  return tok


def tokenizer_config(f: GGUFFile) -> dict[str, Any]:
  """tokenizer_config.json: special tokens and the chat template."""
  tokens = f.require('tokenizer.ggml.tokens')

  def token(key: str) -> str | None:
    i = f.get(f'tokenizer.ggml.{key}_token_id')
    return None if i is None else tokens[int(i)]

  template = f.get('tokenizer.chat_template')
  if template is None:
    raise UnsupportedModelError(
      f'{f.path}: no tokenizer.chat_template (a chat model is expected)'
    )
  return dict(
    # The tokenizer.json already holds the whole pipeline; this class loads
    # it as is in transformers 4.x and 5.x.
    tokenizer_class='PreTrainedTokenizerFast',
    add_bos_token=bool(f.get('tokenizer.ggml.add_bos_token', False)),
    add_prefix_space=False,
    bos_token=token('bos'),
    eos_token=token('eos'),
    pad_token=token('padding'),
    unk_token=token('unknown'),
    chat_template=template,
    clean_up_tokenization_spaces=False,
    model_max_length=int(f.get('{arch}.context_length', 2048)),
  )


# ------------------------------------------------------------------ writing


def convert_gguf(path: str | os.PathLike, out: str | os.PathLike) -> dict:
  """Write the HF directory `out` for the GGUF file `path`; returns the
  config.json dict. Files are written under temporary names and renamed,
  so an interrupted conversion never leaves a half-written checkpoint."""
  from safetensors.numpy import save_file

  f = GGUFFile(path)
  config = hf_config(f)
  out = os.fspath(out)
  os.makedirs(out, exist_ok=True)
  tensors = dict(hf_tensors(f, config))
  tmp = os.path.join(out, '.model.safetensors.tmp')
  save_file(tensors, tmp, metadata={'format': 'pt'})
  del tensors
  tok_config = tokenizer_config(f)
  files = {
    'tokenizer_config.json': tok_config,
    'special_tokens_map.json': {
      k: tok_config[k]
      for k in ('bos_token', 'eos_token', 'pad_token', 'unk_token')
      if tok_config[k] is not None
    },
    'generation_config.json': {
      'bos_token_id': config['bos_token_id'],
      'eos_token_id': config['eos_token_id'],
      'pad_token_id': config['pad_token_id'],
    },
  }
  build_tokenizer(f).save(os.path.join(out, 'tokenizer.json'))
  for name, content in files.items():
    with open(os.path.join(out, name), 'w') as fh:
      json.dump(content, fh, indent=2)
  os.replace(tmp, os.path.join(out, 'model.safetensors'))
  # config.json last: its presence marks a complete directory.
  with open(os.path.join(out, 'config.json'), 'w') as fh:
    json.dump(config, fh, indent=2)
  return config
