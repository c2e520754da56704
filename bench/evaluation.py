"""Evaluation and reward cost on SmolLM2-135M-Instruct (needs `make
smollm2`), or the tiny arithmetic model with --model=tiny.

  python bench/evaluation.py                      # both parts, SmolLM2
  python bench/evaluation.py --parts=eval --prompts=16 --samples=8
  python bench/evaluation.py --model=tiny

(1) eval: replies per second of the greedy pass and of the sampled pass
(`eval.samples` replies per prompt at `eval.preset`), same run, same
engine, same prompts (the data section's held-out set); the first call
compiles and is dropped, then `--repeats` timed calls. Prints the
pass@k / maj@k it measured on the way (the base model's).
(2) reward: the share of the RL step spent scoring the rewards
(`time/reward` / step time) with `math_answer` and with `math_verify`, in
one run whose steps alternate between the two scorers (same model, same
prompts distribution; the first step compiles and is dropped).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

from configs import arith_tiny, smollm2_arith
from jaxcorr.rewards import RewardScorer
from jaxcorr.train.evals.config import EvalConfig
from jaxcorr.train.evals.sets import EvalSet
from jaxcorr.train.evaluation import Evaluator
from jaxcorr.train.loop import Trainer
from jaxcorr.train.rollouts.source import make_rollouts
from jaxcorr.train.rollouts.stage import RolloutStage


def _config(model: str):
  if model == 'tiny':
    config = arith_tiny.get_config()
    config.train.sft_steps = 0
    config.reward.functions = 'exact_match'
    return config
  return smollm2_arith.get_config()


def eval_throughput(model, prompts, samples, preset, repeats) -> None:
  config = _config(model)
  with tempfile.TemporaryDirectory() as workdir:
    trainer = Trainer.from_config(config, workdir, read_only=True)
    stage = trainer.stage
    run = dataclasses.replace(
      trainer.run, eval=EvalConfig(samples=samples, preset=preset)
    )
    stage = RolloutStage(run, stage.engine, stage.tokenizer, stage.scorer)
    examples = trainer.evaluate.sets[0].examples[:prompts]
    evaluator = Evaluator(stage, [EvalSet('', examples)])
    rows = []
    for i in range(repeats + 1):
      out = evaluator(i)
      print(
        f'  call {i}: greedy {out["time/eval"]:.1f}s, sampled '
        f'{out["time/eval_sampled"]:.1f}s',
        flush=True,
      )
      if i:
        rows.append(out)
    trainer.close()
  greedy = statistics.median(r['time/eval'] for r in rows)
  sampled = statistics.median(r['time/eval_sampled'] for r in rows)
  r = run.rollout
  print(
    f'\n{model}: {len(examples)} prompts, <= {r.max_new_tokens} new tokens, '
    f'engine {r.engine_dtype}, {r.max_concurrent_decodes} decode slots; '
    f'sampled: {samples} per prompt, preset {preset}; median of {repeats}'
  )
  print('pass          replies   median s   replies/s')
  print(
    f'  greedy      {len(examples):7d}   {greedy:8.2f}   '
    f'{len(examples) / greedy:9.2f}'
  )
  n = len(examples) * samples
  print(f'  sampled     {n:7d}   {sampled:8.2f}   {n / sampled:9.2f}')
  print(
    f'sampled / greedy replies/s: {(n / sampled) / (len(examples) / greedy):.2f}x'
  )
  last = rows[-1]
  print(
    'measured:',
    ', '.join(f'{k}={v:.3f}' for k, v in last.items() if k.startswith('eval/')),
  )


def reward_share(model, steps) -> None:
  config = _config(model)
  config.train.num_steps = 2 * steps + 1
  config.train.eval_every = 0
  config.train.checkpoint_every = 0
  names = ('math_answer', 'math_verify')
  with tempfile.TemporaryDirectory() as workdir:
    trainer = Trainer.from_config(config, workdir)
    scorers = {}
    for name in names:
      reward = dataclasses.replace(trainer.run.reward, functions=name)
      scorers[name] = RewardScorer.from_config(reward)
      scorers[name].start()
    source = make_rollouts(
      trainer.run, trainer.stage, trainer.loader, trainer.engine_params, start=0
    )
    rows = {name: [] for name in names}
    for s in range(2 * steps + 1):
      name = names[s % 2]
      trainer.stage.scorer = scorers[name]
      t0 = time.perf_counter()
      scored = source.next()
      trainer.train_on(scored)
      trainer.step += 1
      source.publish(trainer.step)
      step = time.perf_counter() - t0
      reward = scored.metrics['time/reward'].value
      accuracy = scored.metrics[f'reward/{name}/mean'].value
      print(
        f'  step {s} {name}: step {step:.2f}s, reward {reward:.3f}s, '
        f'mean reward {accuracy:.3f}',
        flush=True,
      )
      if s:
        rows[name].append((step, reward, scored.batch.batch_size))
    source.close()
    trainer.close()
    for scorer in scorers.values():
      scorer.close()
  print(
    f'\n{model}: reward share of the RL step, {steps} steps each '
    '(alternating, after a compile step)'
  )
  print('reward         step s   reward s   share    replies/s scored')
  for name in names:
    step = statistics.median(x[0] for x in rows[name])
    reward = statistics.median(x[1] for x in rows[name])
    b = rows[name][0][2]
    print(
      f'  {name:12s} {step:7.2f}   {reward:8.3f}   {reward / step:6.1%}  '
      f'{b / reward:9.0f}'
    )


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument('--model', default='smollm2', choices=('smollm2', 'tiny'))
  p.add_argument('--parts', default='eval,reward')
  p.add_argument('--prompts', type=int, default=16)
  p.add_argument('--samples', type=int, default=8)
  p.add_argument('--preset', default='standard')
  p.add_argument('--repeats', type=int, default=2)
  p.add_argument('--steps', type=int, default=2)
  a = p.parse_args()
  parts = a.parts.split(',')
  if 'eval' in parts:
    eval_throughput(a.model, a.prompts, a.samples, a.preset, a.repeats)
  if 'reward' in parts:
    reward_share(a.model, a.steps)


if __name__ == '__main__':
  main()
