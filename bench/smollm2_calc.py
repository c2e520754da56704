"""SmolLM2-135M-Instruct on 3-digit multiplication, greedy, with and
without the calculator tool (configs/smollm2_calc.py), before any RL.

  python bench/smollm2_calc.py --model_dir=~/.cache/jaxcorr/SmolLM2-...
  python bench/smollm2_calc.py --prompts=32

With the tool: the calculator environment (system message with the tool's
schema and the Hermes call format, up to 3 turns). Without: the same
question as one chat turn (configs/smollm2_arith.py's template, 64 new
tokens). Reported: `math_answer` accuracy of the final turn, the tool-call
rate, turns per trajectory, malformed calls.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from configs import base, smollm2_calc
from jaxcorr.model import smollm2
from jaxcorr.train.loop import Trainer

KEYS = (
  'agent/tool_call_rate',
  'agent/turns_mean',
  'agent/malformed_calls',
  'agent/tool_ok',
  'agent/truncated_fraction',
)


def measure(model_dir: str, prompts: int, tool: bool) -> dict:
  def task(c):
    smollm2_calc.apply_task(c, model_dir)
    c.data.eval_examples = prompts
    c.train.eval_prompts = prompts
    c.rollout.max_concurrent_decodes = prompts
    if not tool:
      c.agent.environment = ''
      c.rollout.max_prompt_length = 64
      c.rollout.max_new_tokens = 64

  config = base.get_config(None, task=task)
  with tempfile.TemporaryDirectory() as workdir:
    trainer = Trainer.from_config(config, workdir, config_name='bench')
    examples = trainer.evaluate.examples
    scored = trainer.stage.run_step(examples, step=10**9, greedy=True)
    trainer.close()
  out = {'accuracy': scored.metrics['reward/math_answer/mean'].value}
  for k in KEYS:
    if k in scored.metrics:
      out[k] = scored.metrics[k].value
  return out


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument('--model_dir', default=smollm2.default_dir())
  ap.add_argument('--prompts', type=int, default=16)
  args = ap.parse_args()
  model_dir = os.path.expanduser(args.model_dir)
  for tool in (False, True):
    print('tool' if tool else 'no tool', measure(model_dir, args.prompts, tool))


if __name__ == '__main__':
  main()
