"""SmolLM2-135M-Instruct: the rollout mismatch each engine precision makes,
without training (docs/precision.md).

For each engine (bf16, int8 weights, fp8 weights, int8 weights + int8 KV
cache, fp8 weights with a scale per block of 64 inputs; all bf16
compute) the same 16 arithmetic chat prompts x 2 samples
(the task of configs/smollm2_arith.py, temperature 0.7, up to 16 new
tokens) are sampled, and the fp32 trainer scores them: `rollout_corr/kl`
= mean over response tokens of (μ − π_old) and `k3` = mean(exp(r) − r − 1)
with r = π_old − μ (`jaxcorr.losses.correction.metrics.offpolicy_metrics`'
definitions). For int8 also with matched precision (π_old from the
engine's int8 weights, dequantized: `rollout.matched_precision`).

Usage: python bench/precision_smollm2.py --model_dir=DIR [--batches 2]
       [--engines bf16,int8,fp8,int8+kv8,fp8-b64]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcorr.data.chat import chat_prompt_template
from jaxcorr.model import load_hf, load_tokenizer, token_logprobs
from jaxcorr.model.quantized_weights import QuantSpec, fake_quantize
from jaxcorr.rollout import driver
from jaxcorr.rollout.engine import PolicyEngine

PROMPTS, SAMPLES, NEW, TEMP, WIDTH = 16, 2, 16, 0.7, 80
ENGINES = {
  'bf16': (None, None),
  'int8': (QuantSpec('int8'), None),
  'fp8': (QuantSpec('fp8'), None),
  'int8+kv8': (QuantSpec('int8'), 'int8'),
  'fp8-b64': (QuantSpec('fp8', block=64), None),
}


def _prompts(tok, template, seed):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(PROMPTS):
    a, b = rng.integers(1, 30, 2)
    out.append(tok.encode(template.format(prompt=f'{a}+{b}=')).ids)
  return out


def _rows(batch, prompts):
  """Right-padded prompt + response rows [B, WIDTH], mask of response
  log-prob positions, μ at those positions."""
  b = batch.response_tokens.shape[0]
  toks = np.zeros((b, WIDTH), np.int32)
  mask = np.zeros((b, WIDTH - 1), bool)
  mu = np.zeros((b, WIDTH - 1), np.float32)
  for i in range(b):
    q = prompts[batch.group_id[i]]
    n = int(batch.response_mask[i].sum())
    seq = list(q) + batch.response_tokens[i, :n].tolist()
    toks[i, : len(seq)] = seq
    p = len(q)
    mask[i, p - 1 : p - 1 + n] = True
    mu[i, p - 1 : p - 1 + n] = batch.rollout_logp[i, :n]
  return toks, mask, mu


def _metrics(pi, mu, mask):
  r = np.where(mask, pi - mu, 0.0)
  n = mask.sum()
  return float(-r.sum() / n), float((np.exp(r) - r - 1)[mask].sum() / n)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--model_dir', required=True)
  parser.add_argument('--batches', type=int, default=2)
  parser.add_argument('--engines', default=','.join(ENGINES))
  args = parser.parse_args()
  model = load_hf(args.model_dir)
  tok = load_tokenizer(args.model_dir)
  template = chat_prompt_template(args.model_dir, content='What is {prompt}')
  stop = [tok.token_to_id('<|im_end|>')]
  graphdef, state = nnx.split(model)
  score = jax.jit(
    lambda s, t: token_logprobs(nnx.merge(graphdef, s), t, temperature=TEMP)
  )
  matched = jax.jit(
    lambda s: fake_quantize(
      nnx.merge(graphdef, s), QuantSpec('int8'), jnp.bfloat16
    )
  )(state)
  print(f'device: {jax.devices()[0]}')
  for name in args.engines.split(','):
    spec, kv = ENGINES[name]
    start = time.perf_counter()
    engine = PolicyEngine(
      model,
      max_concurrent_decodes=PROMPTS * SAMPLES,
      max_prefill_length=WIDTH - NEW,
      max_target_length=WIDTH,
      dtype=jnp.bfloat16,
      quantization=spec,
      kv_cache_dtype=kv,
    )
    kls, k3s, mkls, mk3s = [], [], [], []
    for b in range(args.batches):
      prompts = _prompts(tok, template, b)
      batch = driver.generate(
        engine,
        prompts,
        num_samples=SAMPLES,
        max_new_tokens=NEW,
        temperature=TEMP,
        stop_token_ids=stop,
        seed=b,
      )
      toks, mask, mu = _rows(batch, prompts)
      kl, k3 = _metrics(np.asarray(score(state, toks)), mu, mask)
      kls.append(kl)
      k3s.append(k3)
      if name == 'int8':
        kl, k3 = _metrics(np.asarray(score(matched, toks)), mu, mask)
        mkls.append(kl)
        mk3s.append(k3)
    wall = time.perf_counter() - start
    print(
      f'{name:9s} rollout_corr/kl {np.mean(kls):+.5f} (per batch '
      f'{", ".join(f"{x:+.5f}" for x in kls)})  k3 {np.mean(k3s):.5f}  '
      f'({wall:.0f} s)'
    )
    if mkls:
      print(
        f'{"  matched":9s} rollout_corr/kl {np.mean(mkls):+.5f}  k3 '
        f'{np.mean(mk3s):.5f}  (π_old from the int8 weights)'
      )


if __name__ == '__main__':
  main()
