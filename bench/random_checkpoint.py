"""Write a randomly initialised HF checkpoint with a real model's shape.

  python bench/random_checkpoint.py --like=DIR --out=DIR

Reads `DIR/config.json` (and copies its tokenizer files), initialises a
`jaxcorr.model.Transformer` of that shape from seed 0 and writes it with
`jaxcorr.model.save_hf`. For timing runs on a machine the real
weights cannot reach (the device machine has no model hub and a 64 MiB
transfer limit; SmolLM2-135M's float32 weights are 538 MB): step time
does not depend on the values, only response lengths do, and a random
model runs every response to the cap (the worst case for a step).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from flax import nnx

from jaxcorr.model import Transformer, TransformerConfig, save_hf

_TOKENIZER_FILES = (
  'tokenizer.json',
  'tokenizer_config.json',
  'special_tokens_map.json',
  'generation_config.json',
)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--like', required=True, help='directory with config.json')
  ap.add_argument('--out', required=True)
  args = ap.parse_args()
  cfg = TransformerConfig.from_hf_config(args.like)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  save_hf(model, args.out)
  for name in _TOKENIZER_FILES:
    src = os.path.join(args.like, name)
    if os.path.isfile(src):
      shutil.copy(src, os.path.join(args.out, name))
  print(f'{cfg.num_params() / 1e6:.1f}M random params -> {args.out}')


if __name__ == '__main__':
  sys.exit(main())
