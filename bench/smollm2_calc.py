"""SmolLM2-135M-Instruct on multiplication (operands up to 999), greedy,
with and without the calculator tool (configs/smollm2_calc.py): the base
model, or a run's checkpoint (after its SFT warm-up, after RL).

  python bench/smollm2_calc.py                          # the base model
  python bench/smollm2_calc.py --workdir=W --step=0     # after the warm-up
  python bench/smollm2_calc.py --workdir=W              # the latest step

The problems are the config's held-out ones (`data.eval_examples`, drawn
with `data.seed + data.num_examples`), the first `--prompts` of them, the
same for every model. With the tool: the trainer's multi-turn sampler
(`AgentRollouts`) in the calculator environment (system message with the
tool's schema and the Hermes call format, up to 3 turns). Without: the
same question as one chat turn (configs/smollm2_arith.py's template, 64
new tokens) on the same engine and weights. Reported: `math_answer`
accuracy (of the final turn), tool-call rate, turns per trajectory,
malformed calls.

The base model runs on its own engine (bfloat16, as the config); a
checkpoint is restored read-only into the run's own trainer (its config
from the workdir), whose engine then holds that step's weights.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

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
from jaxcorr.data.tasks import Example
from jaxcorr.data.text import make_tokenizer, stop_ids
from jaxcorr.model import load_hf, smollm2
from jaxcorr.rollout import driver
from jaxcorr.rollout.engine import PolicyEngine
from jaxcorr.rollout.state import SamplingParams
from jaxcorr.train.build import build


def measure(
  run: Any,
  engine: PolicyEngine,
  agents: AgentRollouts,
  tok: Any,
  examples: Sequence[Example],
) -> dict[str, float]:
  """Greedy accuracy with the tool (multi-turn) and without (one turn)."""
  _, finals, _, metrics = agents.sample(
    examples, num_samples=1, sp=SamplingParams(1.0, top_k=1), seed=0
  )
  out = {
    'with_tool/accuracy': float(
      np.mean(
        [rewards.math_answer(f, e.answer) for f, e in zip(finals, examples)]
      )
    )
  }
  for k in ('tool_call_rate', 'turns_mean', 'tool_calls', 'malformed_calls',
            'tool_ok', 'truncated_fraction'):  # fmt: skip
    out[f'with_tool/{k}'] = float(metrics[f'agent/{k}'])
  for f, ex in list(zip(finals, examples))[:3]:
    print(repr(ex.prompt), repr(ex.answer), '->', repr(f[:100]))
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
  out['without_tool/accuracy'] = float(
    np.mean([rewards.math_answer(f, e.answer) for f, e in zip(texts, examples)])
  )
  return out


def base_model(model_dir: str, count: int) -> dict[str, float]:
  run = build(
    base.get_config(None, task=lambda c: smollm2_calc.apply_task(c, model_dir))
  )
  model = load_hf(model_dir)
  tok = make_tokenizer(model_dir, model.config)
  r = run.rollout
  engine = PolicyEngine(
    model,
    max_concurrent_decodes=count,
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
  try:
    examples = list(data.make_eval_source(run.data))[:count]
    return measure(run, engine, agents, tok, examples)
  finally:
    agents.close()


def checkpoint(workdir: str, step: int | None, count: int) -> dict[str, float]:
  from jaxcorr.train.evals.checkpoint import load_config
  from jaxcorr.train.loop import Trainer

  config = load_config(workdir, ())
  run = build(config)
  trainer = Trainer(
    run, workdir, config=config, read_only=True, allow_config_change=True
  )
  try:
    trainer.restore(step)
    stage = trainer.stage
    stage.engine.update_params(trainer.engine_params(), version=trainer.step)
    examples = list(data.make_eval_source(run.data))[:count]
    print(f'{workdir} step {trainer.step}')
    return measure(run, stage.engine, stage.agents, trainer.tokenizer, examples)
  finally:
    trainer.close()


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument('--model_dir', default=smollm2.default_dir())
  ap.add_argument('--workdir', default='', help='a smollm2_calc run')
  ap.add_argument('--step', type=int, default=None)
  ap.add_argument('--prompts', type=int, default=64)
  args = ap.parse_args()
  if args.workdir:
    out = checkpoint(args.workdir, args.step, args.prompts)
  else:
    out = base_model(os.path.expanduser(args.model_dir), args.prompts)
  print(json.dumps(out, indent=1))


if __name__ == '__main__':
  main()
