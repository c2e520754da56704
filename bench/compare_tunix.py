"""jaxcorr's `driver.generate` side by side with Tunix's `Sampler`, the JAX
library a user would pick instead (not run in CI).

Same shapes on both sides (`bench/rollout.py`'s workloads: 16 prompts x 4
samples, 32-token prompts, 128 new tokens, a 5M-param Llama-style model,
float32, temperature 1, no truncation): (a) every row runs to the cap,
(b) every 64th token id stops a row. Tunix gets each prompt 4 times (it
has no samples-per-prompt knob); its ids-as-text tokenizer keeps pad and
(for (a)) eos outside the vocabulary so nothing stops a row early. Its
weights are its own random init (timing does not depend on the values);
response lengths of both sides are printed for (b).

Tunix lives in its own environment (its pins differ from jaxcorr's):

    python -m venv /work/tunix-venv
    /work/tunix-venv/bin/pip install google-tunix==0.1.7 'jax[cpu]'
    python bench/compare_tunix.py --tunix-python /work/tunix-venv/bin/python

(or `pip install -e .[bench]` where one environment can hold both). Both
sides run in warm worker processes, alternating repetitions; the report
gives median tokens/s and the median paired ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import rollout as bench  # bench/rollout.py: workloads, workers, report


class _IdTokenizer:
  """Space-separated ids; bos 0 (= none), pad and eos past the vocab."""

  def __init__(self, vocab: int):
    self.vocab = vocab

  def encode(self, text: str, **kwargs) -> list[int]:
    del kwargs
    return [int(t) for t in text.split()]

  def decode(self, ids, **kwargs) -> str:
    del kwargs
    return ' '.join(str(int(t)) for t in ids)

  def bos_id(self) -> int:
    return 0

  def eos_id(self) -> int:
    return self.vocab + 2

  def pad_id(self) -> int:
    return self.vocab + 1


def _tunix_worker() -> None:
  import jax
  from flax import nnx
  from tunix.generate import sampler as sampler_lib
  from tunix.models.llama3 import model as llama3

  m = bench.MODEL
  config = llama3.ModelConfig(
    num_layers=m['num_layers'],
    vocab_size=m['vocab_size'],
    embed_dim=m['hidden_size'],
    hidden_dim=m['intermediate_size'],
    num_heads=m['num_heads'],
    head_dim=m['hidden_size'] // m['num_heads'],
    num_kv_heads=m['num_kv_heads'],
    rope_theta=int(m['rope_theta']),
    norm_eps=1e-6,
  )
  model = llama3.Llama3(config, rngs=nnx.Rngs(0))
  tok = _IdTokenizer(m['vocab_size'])
  sampler = sampler_lib.Sampler(
    model,
    tok,
    sampler_lib.CacheConfig(
      cache_size=bench.PROMPT_LEN + bench.NEW,
      num_layers=config.num_layers,
      num_kv_heads=config.num_kv_heads,
      head_dim=config.head_dim,
    ),
  )
  texts = [tok.decode(p) for p in bench.prompts() for _ in range(bench.SAMPLES)]

  def run(workload: str, seed: int) -> dict:
    stop = bench.stop_ids(workload) or [tok.eos_id()]
    t0 = time.perf_counter()
    out = sampler(
      texts,
      max_generation_steps=bench.NEW,
      max_prompt_length=bench.PROMPT_LEN,
      return_logprobs=True,
      eos_tokens=stop,
      temperature=1.0,
      top_p=1.0,
      seed=seed,
    )
    jax.block_until_ready(out.logprobs)
    secs = time.perf_counter() - t0
    # Tunix cuts each row before its eos; jaxcorr keeps the stop token in
    # the response: count it on Tunix's side too.
    lengths = [min(len(t) + 1, bench.NEW) for t in out.tokens]
    return dict(seconds=secs, tokens=int(sum(lengths)), lengths=lengths)

  bench.serve(run, name=f'tunix {sampler_lib.__file__}')


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument('--worker', action='store_true')
  ap.add_argument('--tunix-python', default='/work/tunix-venv/bin/python')
  ap.add_argument('--reps', type=int, default=5)
  ap.add_argument('--decode-chunk', type=int, default=32)
  args = ap.parse_args()
  if args.worker:
    _tunix_worker()
    return
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  workers = [bench.jaxcorr_worker('jaxcorr', here, args.decode_chunk)]
  workers.append(
    bench.Worker(
      'tunix',
      [args.tunix_python, os.path.abspath(__file__), '--worker'],
      here,
      {'PYTHONPATH': os.path.dirname(os.path.abspath(__file__))},
    )
  )
  for w in workers:
    print(f'{w.label}: {w.name}')
  try:
    results = bench.alternate(workers, args.reps)
  finally:
    for w in workers:
      w.close()
  bench.report(results, 'jaxcorr', 'tunix')
  for w, sides in results.items():
    tl = np.concatenate([r['lengths'] for r in sides['tunix']])
    print(f'({w}) tunix response length mean {tl.mean() / bench.NEW:.0%}')
  sys.stdout.flush()


if __name__ == '__main__':
  main()
