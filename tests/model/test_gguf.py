"""The GGUF import (`python -m jaxcorr.convert --gguf=...`,
jaxcorr/model/gguf.py) without a network.

tests/model/fixtures/tiny_llama.gguf is a random 2-layer Llama written as
llama.cpp writes one (make_tiny_llama_gguf.py beside it): Q4_1 and Q8_0
matrices, Q/K rows permuted per head, tied embeddings, a byte-level BPE
vocabulary with a ChatML template. It is converted once; the directory
loads in `load_hf`, and transformers' own GGUF loader, reading the same
file, has the same float32 weights bit for bit, the same logits and the
same chat-prompt ids. tests/model/test_smollm2.py does the same on the real
SmolLM2 file.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jaxcorr.data import prompts as data
from jaxcorr.data import text
from jaxcorr.data.chat import chat_prompt_template
from jaxcorr.data.tasks import Example
from jaxcorr.model import load_hf
from jaxcorr.model.gguf import _unpermute
from tests.helpers import process_group
from tests.helpers.model_testing import forward
from tests.model.fixtures import make_tiny_llama_gguf as script

FIXTURES = pathlib.Path(__file__).resolve().parent / 'fixtures'
GGUF = FIXTURES / 'tiny_llama.gguf'
QUESTIONS = ['the 12 + 3 = 15 is on', 'What is 17 + 25?', ' the  is\té 2024']
# Both sides run float32 on the same weights: logits of magnitude ~13 differ
# by float32 rounding only (measured 1.8e-5).
LOGITS_ATOL = 1e-4


@pytest.fixture(scope='module')
def hf_dir(tmp_path_factory) -> str:
  out = tmp_path_factory.mktemp('tiny_llama_hf')
  proc = subprocess.run(
    [sys.executable, '-m', 'jaxcorr.convert', f'--gguf={GGUF}', f'--out={out}'],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=process_group.REPO,
    env=process_group.clean_env(),
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert '(2 layers, vocab 268)' in proc.stdout, proc.stdout
  return str(out)


def _transformers():
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  pytest.importorskip('accelerate')  # transformers' GGUF path needs it
  return torch, transformers


def _reference(transformers, torch):
  return transformers.AutoModelForCausalLM.from_pretrained(
    str(FIXTURES), gguf_file=GGUF.name, dtype=torch.float32
  ).eval()


def test_fixture_is_what_its_script_writes(tmp_path, monkeypatch):
  """The committed file is reproducible from make_tiny_llama_gguf.py."""
  monkeypatch.setattr(script, 'OUT', tmp_path / GGUF.name)
  script.main()
  assert (tmp_path / GGUF.name).read_bytes() == GGUF.read_bytes()


def test_converted_directory_loads_with_its_config(hf_dir):
  with open(f'{hf_dir}/config.json') as f:
    raw = json.load(f)
  assert raw['architectures'] == ['LlamaForCausalLM']
  assert raw['tie_word_embeddings'] and raw['torch_dtype'] == 'float32'
  model = load_hf(hf_dir)
  cfg = model.config
  assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (2, 64, 268)
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
  assert cfg.tie_embeddings and cfg.rope_theta == 1e4
  assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
  tok = text.make_tokenizer(hf_dir, cfg)
  assert tok.stop_ids == (2,)


def test_unpermute_inverts_llama_cpp_q_k_permutation():
  """llama.cpp writes each head's rows [first half | second half] of HF's
  rotate-half RoPE interleaved as (r0, r_half, r1, r_half+1, ...)."""
  heads, head_dim, n_in = 3, 8, 5
  hf = np.arange(heads * head_dim * n_in, dtype=np.float32).reshape(-1, n_in)
  order = []
  for h in range(heads):
    base, half = h * head_dim, head_dim // 2
    for i in range(half):
      order += [base + i, base + half + i]
  gguf_rows = hf[order]
  np.testing.assert_array_equal(_unpermute(gguf_rows, heads), hf)


def test_weights_equal_transformers_gguf_loader(hf_dir):
  """Dequantized, un-permuted, tied: the float32 weights transformers
  reads from the same file, bit for bit."""
  from safetensors.numpy import load_file

  torch, transformers = _transformers()
  ref = _reference(transformers, torch).state_dict()
  ours = load_file(f'{hf_dir}/model.safetensors')
  assert set(ref) - set(ours) == {'lm_head.weight'}  # tied
  for name, x in ours.items():
    np.testing.assert_array_equal(x, ref[name].numpy(), err_msg=name)


def _prompt_ids(hf_dir, model) -> list[list[int]]:
  """The QUESTIONS as the trainer encodes them (RolloutStage.encode)."""
  tok = text.make_tokenizer(hf_dir, model.config)
  template = chat_prompt_template(hf_dir)
  return [
    tok.encode(data.format_prompt(template, Example(q, ''))) for q in QUESTIONS
  ]


def test_chat_prompt_ids_equal_transformers_gguf_tokenizer(hf_dir):
  _, transformers = _transformers()
  ref = transformers.AutoTokenizer.from_pretrained(
    str(FIXTURES), gguf_file=GGUF.name
  )
  for question, ids in zip(QUESTIONS, _prompt_ids(hf_dir, load_hf(hf_dir))):
    out = ref.apply_chat_template(
      [{'role': 'user', 'content': question}],
      add_generation_prompt=True,
      tokenize=True,
    )
    want = list(out['input_ids'] if hasattr(out, 'keys') else out)
    assert ids == want, question


def test_logits_equal_transformers_gguf_loader(hf_dir):
  torch, transformers = _transformers()
  model = load_hf(hf_dir)
  rows = _prompt_ids(hf_dir, model)
  tokens = np.full((len(rows), max(map(len, rows))), 2, np.int32)
  for i, r in enumerate(rows):
    tokens[i, : len(r)] = r
  ours = np.asarray(forward(model, jnp.asarray(tokens)))
  with torch.no_grad():
    ref = _reference(transformers, torch)(torch.as_tensor(tokens)).logits
  ref = ref.numpy()
  assert np.abs(ref).max() > 1.0  # not a degenerate model
  for i, ids in enumerate(rows):
    a, b = ours[i, : len(ids)], ref[i, : len(ids)]
    np.testing.assert_allclose(a, b, atol=LOGITS_ATOL, rtol=0)
    assert (a.argmax(-1) == b.argmax(-1)).all()


def test_gguf_of_another_architecture_is_refused(tmp_path):
  gguf = pytest.importorskip('gguf')
  from jaxcorr.model import UnsupportedModelError
  from jaxcorr.model.gguf import GGUFFile

  path = str(tmp_path / 'gemma.gguf')
  w = gguf.GGUFWriter(path, 'gemma')
  w.add_block_count(1)
  w.add_tensor('token_embd.weight', np.zeros((4, 8), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(UnsupportedModelError, match="supported: 'llama'"):
    GGUFFile(path)


def _write_tiny_llama_gguf(path: str) -> int:
  """A complete one-layer llama GGUF with a byte-level vocabulary of 300
  tokens (so its header alone is longer than 1000 bytes); its size."""
  gguf = pytest.importorskip('gguf')
  hidden, heads, ffn, vocab = 16, 2, 32, 300
  rng = np.random.default_rng(0)
  w = gguf.GGUFWriter(path, 'llama')
  w.add_block_count(1)
  w.add_embedding_length(hidden)
  w.add_feed_forward_length(ffn)
  w.add_head_count(heads)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_tokenizer_model('gpt2')
  w.add_token_list(
    ['t', 'o', 'k', 'to', 'tok'] + [f'tok{i}' for i in range(vocab - 5)]
  )
  w.add_token_merges(['t o', 'to k'])
  w.add_eos_token_id(0)
  w.add_chat_template('{{ messages[0]["content"] }}')
  shapes = {
    'token_embd.weight': (vocab, hidden),
    'output_norm.weight': (hidden,),
    'blk.0.attn_norm.weight': (hidden,),
    'blk.0.attn_q.weight': (hidden, hidden),
    'blk.0.attn_k.weight': (hidden, hidden),
    'blk.0.attn_v.weight': (hidden, hidden),
    'blk.0.attn_output.weight': (hidden, hidden),
    'blk.0.ffn_norm.weight': (hidden,),
    'blk.0.ffn_gate.weight': (ffn, hidden),
    'blk.0.ffn_up.weight': (ffn, hidden),
    'blk.0.ffn_down.weight': (hidden, ffn),
  }
  for name, shape in shapes.items():
    w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with open(path, 'rb') as f:
    return len(f.read())


@pytest.mark.parametrize('cut', ['to_1000_bytes', 'to_half', 'last_1000'])
def test_truncated_gguf_is_one_clear_error(tmp_path, cut):
  """A GGUF cut short names the file, where it ends and the bytes missing,
  in the library and as one line from `python -m jaxcorr.convert`; the
  complete file converts."""
  import os
  import subprocess
  import sys

  from jaxcorr.model.gguf import TruncatedGGUFError, convert_gguf

  whole = str(tmp_path / 'whole.gguf')
  size = _write_tiny_llama_gguf(whole)
  config = convert_gguf(whole, str(tmp_path / 'whole_hf'))
  assert config['num_hidden_layers'] == 1
  keep = {'to_1000_bytes': 1000, 'to_half': size // 2, 'last_1000': size - 1000}
  path = str(tmp_path / f'{cut}.gguf')
  with open(whole, 'rb') as f, open(path, 'wb') as g:
    g.write(f.read()[: keep[cut]])
  with pytest.raises(TruncatedGGUFError) as err:
    convert_gguf(path, str(tmp_path / 'out'))
  msg = str(err.value)
  assert msg.startswith(f'{path}: truncated GGUF file'), msg
  assert f'ends at byte {keep[cut]}' in msg, msg
  if cut == 'to_1000_bytes':  # inside the vocabulary
    assert "header (metadata 'tokenizer.ggml.tokens')" in msg, msg
  else:
    assert "tensor 'blk.0." in msg or "tensor 'token_embd" in msg, msg
    assert f'{size - keep[cut]} bytes missing' in msg, msg
  assert not os.path.exists(tmp_path / 'out')

  root = str(pathlib.Path(__file__).resolve().parents[2])
  proc = subprocess.run(
    [sys.executable, '-m', 'jaxcorr.convert', f'--gguf={path}', '--out=x'],
    cwd=tmp_path,
    env={**os.environ, 'PYTHONPATH': root},
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 1, proc.stderr
  assert proc.stdout == '', proc.stdout
  assert proc.stderr.strip().splitlines() == [f'convert: {msg}'], proc.stderr
