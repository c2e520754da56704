"""SmolLM2-135M-Instruct on multiplication (operands up to 999), greedy,
with the calculator tool (configs/smollm2_calc.py), before any RL.

  python bench/smollm2_calc.py --model_dir=~/.cache/jaxcorr/SmolLM2-...
  python bench/smollm2_calc.py --prompts=32

No trainer is built (no optimizer state): the model, the rollout engine
(bfloat16, as the config) and the multi-turn sampler of the trainer
(`AgentRollouts`) on the first problems of the config's data source. With the tool: the
calculator environment (system message with the tool's schema and the
Hermes call format, up to 3 turns); without: the same question as one
chat turn (configs/smollm2_arith.py's template, 64 new tokens). Reported:
`math_answer` accuracy (of the final turn), tool-call rate, turns per
trajectory, malformed calls.
"""

from __future__ import annotations

import argparse
import os

import jax.numpy as jnp
import numpy as np

from configs import base, smollm2_calc
from jaxcorr import rewards
from jaxcorr.agents.episodes import (
  AgentRollouts,
  engine_headroom,
  turn_template,
)
from jaxcorr.data import prompts as data
from jaxcorr.data.text import make_tokenizer, stop_ids
from jaxcorr.model import load_hf, smollm2
from jaxcorr.rollout import driver
from jaxcorr.rollout.engine import PolicyEngine
from jaxcorr.rollout.state import SamplingParams
from jaxcorr.train.build import build


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument('--model_dir', default=smollm2.default_dir())
  ap.add_argument('--prompts', type=int, default=16)
  args = ap.parse_args()
  model_dir = os.path.expanduser(args.model_dir)
  run = build(
    base.get_config(None, task=lambda c: smollm2_calc.apply_task(c, model_dir))
  )
  model = load_hf(model_dir)
  tok = make_tokenizer(model_dir, model.config)
  r = run.rollout
  engine = PolicyEngine(
    model,
    max_concurrent_decodes=args.prompts,
    max_prefill_length=r.max_prompt_length,
    max_target_length=r.max_prompt_length
    + r.max_new_tokens
    + engine_headroom(run.agent),
    dtype=jnp.dtype(r.engine_dtype),
    decode_chunk=r.decode_chunk,
  )
  agents = AgentRollouts(
    run.agent,
    engine,
    tok,
    turn_template(run.agent, model_dir),
    stop_ids(tok),
    prompt_length=r.max_prompt_length,
    response_length=r.max_new_tokens,
  )
  source = data.make_source(run.data)
  examples = [source[i] for i in range(args.prompts)]
  _, finals, _, metrics = agents.sample(
    examples, num_samples=1, sp=SamplingParams(1.0, top_k=1), seed=0
  )
  correct = [
    rewards.math_answer(f, ex.answer) for f, ex in zip(finals, examples)
  ]
  print('accuracy with the tool:', float(np.mean(correct)))
  for k in ('agent/tool_call_rate', 'agent/turns_mean', 'agent/tool_calls',
            'agent/malformed_calls', 'agent/tool_ok',
            'agent/truncated_fraction'):  # fmt: skip
    print(k, metrics[k])
  for f, ex in list(zip(finals, examples))[:4]:
    print(repr(ex.prompt), repr(ex.answer), '->', repr(f[:120]))
  agents.close()
  # Without the tool: the question as one chat turn (the template of
  # configs/smollm2_arith.py), 64 new tokens, on the same engine.
  prompts = [
    tok.encode(data.format_prompt(run.data.prompt_template, ex))
    for ex in examples
  ]
  plain = driver.generate(
    engine, prompts, max_new_tokens=64, top_k=1, stop_token_ids=stop_ids(tok)
  )
  texts = [
    tok.decode(t[m].tolist())
    for t, m in zip(plain.response_tokens, plain.context_mask)
  ]
  correct = [
    rewards.math_answer(f, ex.answer) for f, ex in zip(texts, examples)
  ]
  print('accuracy without the tool:', float(np.mean(correct)))


if __name__ == '__main__':
  main()
