"""SmolLM2-135M-Instruct through the trainer: RL steps, export, transformers.

Slow (minutes of CPU: a 135M model's rollouts, updates and a checkpoint
with AdamW state); `tests/model/test_smollm2.py` holds the fast checks.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from configs import base, smollm2_arith
from jaxcorr.train.loop import Trainer

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]


def config(smol_dir, preset: str, **changes):
  def task(c):
    smollm2_arith.apply_task(c, model_dir=smol_dir)
    smollm2_arith.apply_pulse(c)
    for key, value in changes.items():
      section, field = key.split('__')
      c[section][field] = value

  return base.get_config(preset, task=task)


def test_export_round_trip_generates_in_transformers(smol_dir, tmp_path):
  """A run's checkpoint -> `python -m jaxcorr.export` -> transformers loads
  it (weights, config with the eos id, tokenizer with the chat template)
  and generates what it generates from the source model: the run saved
  its initial weights (step 0), so both are SmolLM2 itself."""
  workdir, out = tmp_path / 'run', tmp_path / 'hf'
  cfg = config(smol_dir, 'disabled', train__num_steps=0, train__eval_every=0)
  trainer = Trainer.from_config(cfg, str(workdir))
  trainer.train()  # no steps: config.json and checkpoint 0, as a run writes
  trainer.close()
  subprocess.run(
    [
      sys.executable,
      '-m',
      'jaxcorr.export',
      f'--workdir={workdir}',
      f'--out={out}',
    ],
    check=True,
  )
  hf = json.loads((out / 'config.json').read_text())
  assert hf['architectures'] == ['LlamaForCausalLM']
  assert hf['eos_token_id'] == 2 and hf['tie_word_embeddings']
  tok = transformers.AutoTokenizer.from_pretrained(str(out))
  ids = tok.apply_chat_template(
    [{'role': 'user', 'content': 'What is 17+25='}],
    add_generation_prompt=True,
    tokenize=True,
    return_dict=True,
    return_tensors='pt',
  )
  outputs = []
  for path in (out, smol_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(
      str(path), dtype=torch.float32
    ).eval()
    with torch.no_grad():
      gen = model.generate(**ids, max_new_tokens=12, do_sample=False)
    outputs.append(gen[0, ids['input_ids'].shape[1] :].tolist())
  assert outputs[0] == outputs[1]
  text = tok.decode(outputs[0], skip_special_tokens=True)
  assert any(c.isdigit() for c in text), text


# The run of `make run-smollm2`, shrunk: in its own process, so on one CPU
# device like the CLI (this process has 8 fake ones; a 135M model's update
# sharded over them on 2 loaded cores aborted inside XLA twice).
_SHORT_RUN = """
import sys
from configs import base, smollm2_arith
from jaxcorr.train.loop import Trainer

def task(c):
  smollm2_arith.apply_task(c, model_dir=sys.argv[1])
  c.train.num_steps = 12
  c.train.eval_every = 0
  c.train.checkpoint_every = 0

trainer = Trainer.from_config(base.get_config('decoupled_token_is', task=task), sys.argv[2])
trainer.train()
trainer.close()
"""


def test_short_run_raises_the_reward(smol_dir, tmp_path):
  """A short GRPO run on the real model: the mean sampled reward of the
  last 4 of 12 steps exceeds that of the first 4 (fixed seeds; the
  config's 8 x 4 rows at temperature 0.7; ~10 min of a quiet 2-core CPU;
  the full 16-step runs of docs/smollm2.md section 3 went from ~0.1-0.2
  to ~0.45)."""
  subprocess.run(
    [sys.executable, '-c', _SHORT_RUN, smol_dir, str(tmp_path)],
    check=True,
    cwd=ROOT,
  )
  rows = [
    json.loads(line)
    for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()
  ]
  rewards = [r['reward/mean'] for r in rows if 'reward/mean' in r]
  assert len(rewards) == 12
  assert np.mean(rewards[-4:]) > np.mean(rewards[:4]), rewards
