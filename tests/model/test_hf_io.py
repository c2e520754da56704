"""HF checkpoint I/O without torch: save_hf -> load_hf round trips (single
file and sharded index, list and scanned layers, bf16 files, sharded
placement), the error messages, and the tokenizer."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from safetensors.numpy import load_file, save_file

from jaxcorr import sharding as sh
from jaxcorr.model import (
  UnsupportedModelError,
  WeightsMismatchError,
  load_hf,
  load_tokenizer,
  save_hf,
)
from jaxcorr.model.hf_io import INDEX_FILE, SINGLE_FILE
from tests.helpers.model_testing import (
  forward,
  random_model,
  random_tokens,
  shard_batch,
  stack_layers,
  tiny_config,
)


def _assert_same_params(a, b):
  pa, pb = (
    stack_layers(nnx.state(a, nnx.Param)),
    stack_layers(nnx.state(b, nnx.Param)),
  )
  assert pa.keys() == pb.keys()
  for k in pa:
    assert pa[k].dtype == pb[k].dtype, k
    np.testing.assert_array_equal(pa[k], pb[k], err_msg=str(k))


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
  """A random Llama-style model (untied, q/k/v/o biases) saved in 3+ shards."""
  model = random_model(
    tiny_config(architecture='LlamaForCausalLM', o_bias=True)
  )
  path = tmp_path_factory.mktemp('ckpt')
  save_hf(model, path, max_shard_bytes=40_000)
  return model, path


def test_sharded_save_writes_an_index(checkpoint):
  model, path = checkpoint
  index = json.loads((path / INDEX_FILE).read_text())
  files = sorted(set(index['weight_map'].values()))
  assert len(files) >= 3 and not (path / SINGLE_FILE).exists()
  assert all((path / f).exists() for f in files)
  assert not [f for f in os.listdir(path) if f.startswith('.tmp')]
  names = set(index['weight_map'])
  assert (
    'lm_head.weight' in names
    and 'model.layers.1.self_attn.o_proj.bias' in names
  )
  config = json.loads((path / 'config.json').read_text())
  assert config['architectures'] == ['LlamaForCausalLM']
  assert config['attention_bias'] is True and config['head_dim'] == 8
  # HF layout: [out, in].
  q = load_file(
    path / index['weight_map']['model.layers.0.self_attn.q_proj.weight']
  )
  np.testing.assert_array_equal(
    q['model.layers.0.self_attn.q_proj.weight'],
    np.asarray(model.layers[0].attn.q_proj.kernel[...]).reshape(64, 64).T,
  )


@pytest.mark.parametrize('scan', [False, True])
def test_round_trip_is_exact(checkpoint, scan):
  model, path = checkpoint
  loaded = load_hf(path, scan_layers=scan)
  assert loaded.config == model.config.replace(scan_layers=scan)
  _assert_same_params(model, loaded)


def test_round_trip_tied_single_file_bf16(tmp_path):
  model = random_model(
    tiny_config(tie_embeddings=True, scan_layers=True, num_layers=1)
  )
  save_hf(model, tmp_path, dtype='bfloat16')
  assert (tmp_path / SINGLE_FILE).exists() and not (
    tmp_path / INDEX_FILE
  ).exists()
  tensors = load_file(tmp_path / SINGLE_FILE)
  assert 'lm_head.weight' not in tensors
  assert {t.dtype for t in tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}
  config = json.loads((tmp_path / 'config.json').read_text())
  assert (
    config['tie_word_embeddings'] is True
    and config['torch_dtype'] == 'bfloat16'
  )
  loaded = load_hf(tmp_path, param_dtype='bfloat16', scan_layers=True)
  assert loaded.config.param_dtype == jnp.bfloat16
  got = stack_layers(nnx.state(loaded, nnx.Param))
  for k, x in stack_layers(nnx.state(model, nnx.Param)).items():
    np.testing.assert_array_equal(
      got[k], x.astype(jnp.bfloat16), err_msg=str(k)
    )


@pytest.mark.parametrize('scan', [False, True])
def test_load_places_params_in_their_shardings(checkpoint, scan, tmp_path):
  model, path = checkpoint
  mesh = sh.make_mesh(dict(fsdp=2, tensor=4))
  loaded = load_hf(path, mesh=mesh, scan_layers=scan)
  for p, var in nnx.to_flat_state(nnx.state(loaded, nnx.Param)):
    axes = var.get_metadata()['logical_axes']
    spec = sh.logical_to_spec(axes, shape=var.shape, mesh=mesh)
    assert var.get_value().sharding == NamedSharding(mesh, spec), p
  embed = loaded.embed.get_value()
  assert embed.addressable_shards[0].data.shape == (32, 32)  # vocab/4, embed/2
  _assert_same_params(model, loaded)
  tokens = random_tokens(2, 12)
  with jax.set_mesh(mesh):
    logits = forward(loaded, shard_batch(tokens, mesh))
  np.testing.assert_allclose(logits, forward(model, tokens), atol=2e-5)
  # And back out: save_hf gathers the shards.
  save_hf(loaded, tmp_path)
  _assert_same_params(model, load_hf(tmp_path, scan_layers=scan))


# ------------------------------------------------------------------ errors


def _copy(src, dst, drop=(), add=None, config=None):
  dst.mkdir()
  tensors = {}
  index = json.loads((src / INDEX_FILE).read_text())
  for f in set(index['weight_map'].values()):
    tensors.update(load_file(src / f))
  for k in drop:
    del tensors[k]
  tensors.update(add or {})
  save_file(tensors, dst / SINGLE_FILE, metadata={'format': 'pt'})
  cfg = json.loads((src / 'config.json').read_text())
  cfg.update(config or {})
  (dst / 'config.json').write_text(json.dumps(cfg))
  return dst


def test_load_errors(checkpoint, tmp_path):
  _, path = checkpoint
  with pytest.raises(FileNotFoundError, match='no checkpoint directory'):
    load_hf(tmp_path / 'nope')
  (tmp_path / 'empty').mkdir()
  with pytest.raises(FileNotFoundError, match='config'):
    load_hf(tmp_path / 'empty')
  (tmp_path / 'empty' / 'config.json').write_text(
    (path / 'config.json').read_text()
  )
  with pytest.raises(FileNotFoundError, match=r'model\.safetensors'):
    load_hf(tmp_path / 'empty')

  bad = _copy(
    path, tmp_path / 'arch', config=dict(architectures=['GPT2LMHeadModel'])
  )
  with pytest.raises(UnsupportedModelError, match='GPT2LMHeadModel'):
    load_hf(bad)
  bad = _copy(path, tmp_path / 'shape', config=dict(intermediate_size=96))
  with pytest.raises(
    WeightsMismatchError,
    match=r'mlp.\w+_proj.weight .* has shape \((128, 64|64, 128)\), but config.json implies',
  ):
    load_hf(bad)
  bad = _copy(
    path, tmp_path / 'missing', drop=['model.layers.1.mlp.up_proj.weight']
  )
  with pytest.raises(
    WeightsMismatchError, match=r'missing \[.model.layers.1.mlp.up_proj'
  ):
    load_hf(bad)
  extra = {'model.layers.0.mlp.up_proj.bias': np.zeros(128, np.float32)}
  bad = _copy(path, tmp_path / 'extra', add=extra)
  with pytest.raises(WeightsMismatchError, match=r'unexpected .*up_proj\.bias'):
    load_hf(bad)
  # Ignorable extras load fine: rotary tables, a head next to tied weights.
  extra = {
    'model.layers.0.self_attn.rotary_emb.inv_freq': np.ones(4, np.float32)
  }
  ok = _copy(
    path, tmp_path / 'ok', add=extra, config=dict(tie_word_embeddings=True)
  )
  assert load_hf(ok).lm_head is None

  # A config HF cannot express is refused before anything is written.
  odd = random_model(tiny_config(architecture='LlamaForCausalLM', num_layers=1))
  with pytest.raises(UnsupportedModelError, match='together'):
    save_hf(odd, tmp_path / 'odd')
  assert not (tmp_path / 'odd').exists()

  index = tmp_path / 'index'
  index.mkdir()
  for f in ('config.json', INDEX_FILE):
    (index / f).write_text((path / f).read_text())
  with pytest.raises(FileNotFoundError, match='missing in'):
    load_hf(index)


# --------------------------------------------------------------- tokenizer


def test_tokenizer_is_copied_and_loaded(tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers

  vocab = {'[UNK]': 0, 'hello': 1, 'world': 2, '!': 3}
  tok = Tokenizer(models.WordLevel(vocab, unk_token='[UNK]'))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  src = tmp_path / 'src'
  src.mkdir()
  tok.save(str(src / 'tokenizer.json'))
  (src / 'tokenizer_config.json').write_text('{}')
  with pytest.raises(FileNotFoundError, match=r'tokenizer\.json'):
    load_tokenizer(tmp_path)
  out = tmp_path / 'out'
  save_hf(random_model(tiny_config(num_layers=1)), out, tokenizer_dir=src)
  assert (out / 'tokenizer_config.json').exists()
  assert load_tokenizer(out).encode('hello world !').ids == [1, 2, 3]
