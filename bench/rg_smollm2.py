"""The figures of a configs/smollm2_rg.py run (reasoning-gym chain_sum on
SmolLM2-135M-Instruct), read from its workdir, and the reward cost of the
task's scorer against math-verify on the run's own eval replies.

  python bench/rg_smollm2.py --workdir=/work/runs/rg_s0 [--workdir=...]

Per run (metrics.jsonl, written by the trainer):
(1) eval: replies per second of the greedy pass (`time/eval`) and of the
sampled pass (`time/eval_sampled`) at each eval step, same run, same
engine, same prompts; the reply counts come from the step's eval JSONL.
Step 0's calls compile the eval programs; later eval steps reuse them.
(2) reward: the share of the RL step spent in rewards, `time/reward` /
`time/step`, medians over the steps without an evaluation (an eval
step's `time/step` includes the evaluation).
(3) before / after: greedy accuracy, pass@1, pass@k, maj@k per eval step.

Then, on the replies of the eval JSONL files (every reply of every eval
step of the runs given): seconds per reply of the `reasoning_gym` reward
(the row's key regenerated, the task's `score_answer`) and of the
`math_verify` reward against the task's answer text, called one after
the other on the same replies in this process (first calls, which import
and build, timed apart); where they disagree; and math-verify's share of
the step had the run scored with it: its per-reply time times the replies
of a step over the run's median step time (a projection:
`data.source='reasoning_gym'` refuses `math_verify`, whose reference
would be the row's key, so no run measures it in the loop).
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import statistics
import time

from jaxcorr.data import reasoning_gym as rg_data
from jaxcorr.rewards import math_verify_reward, reasoning_gym_reward


def _rows(path: pathlib.Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines() if line]


def run_figures(workdir: pathlib.Path) -> tuple[float, int]:
  """Prints (1)-(3) of one run; returns its median step time and the
  replies per RL step."""
  config = json.loads((workdir / 'config.json').read_text())
  rollout = config['rollout']
  per_step = rollout['prompts_per_step'] * rollout['samples_per_prompt']
  metrics = _rows(workdir / 'metrics.jsonl')
  print(f'\n== {workdir} (seed {config["train"]["seed"]})')
  print('eval step  pass      replies   s        replies/s')
  for m in metrics:
    if 'time/eval' not in m:
      continue
    replies = collections.Counter(
      r['mode']
      for r in _rows(workdir / 'eval_samples' / f'step_{m["step"]}.jsonl')
    )
    for mode, key in (
      ('greedy', 'time/eval'),
      ('sampled', 'time/eval_sampled'),
    ):
      if key in m:
        n = replies[mode]
        print(
          f'{m["step"]:9d}  {mode:8s} {n:7d}  {m[key]:8.2f}  {n / m[key]:9.2f}'
        )
    if 'time/eval_sampled' in m:
      ratio = (replies['sampled'] / m['time/eval_sampled']) / (
        replies['greedy'] / m['time/eval']
      )
      print(f'{"":9s}  sampled / greedy replies/s: {ratio:.2f}x')
  steps = [m for m in metrics if 'time/step' in m and 'time/eval' not in m]
  step = statistics.median(m['time/step'] for m in steps)
  reward = statistics.median(m['time/reward'] for m in steps)
  print(
    f'RL steps without eval: {len(steps)}, {per_step} replies each; median '
    f'step {step:.2f}s, reward {reward:.3f}s, share {reward / step:.2%}'
  )
  for m in metrics:
    if 'eval/accuracy' in m:
      shown = {
        k[len('eval/') :]: round(v, 4)
        for k, v in m.items()
        if k.startswith('eval/')
        and k.split('/')[-1].split('@')[0]
        in ('accuracy', 'pass', 'maj', 'sampled_accuracy')
      }
      print(f'step {m["step"]}: {shown}')
  return step, per_step


def _timed(fn, pairs) -> tuple[list[float], float]:
  t0 = time.perf_counter()
  out = [fn(a, b) for a, b in pairs]
  return out, time.perf_counter() - t0


def reward_cost(replies: list[dict], step: float, per_step: int) -> None:
  keys = [r['answer'] for r in replies]
  texts = [r['reply'] for r in replies]
  truth = [rg_data.entry(k)[1]['answer'] for k in keys]
  # First calls apart: imports, grammar set-up, the dataset's generation.
  t0 = time.perf_counter()
  math_verify_reward(texts[0], truth[0])
  first_mv = time.perf_counter() - t0
  rg, t_rg = _timed(reasoning_gym_reward, zip(texts, keys))
  mv, t_mv = _timed(math_verify_reward, zip(texts, truth))
  n = len(replies)
  print(f'\nrewards on {n} eval replies (this process, one after the other)')
  print('reward          s total   ms/reply   replies/s   projected share')
  for name, t in (('reasoning_gym', t_rg), ('math_verify', t_mv)):
    share = t / n * per_step / step
    print(
      f'  {name:13s} {t:8.3f}  {1e3 * t / n:9.3f}  {n / t:10.0f}   '
      f'{share:.2%} of a {step:.1f}s step'
    )
  print(f'  (math_verify first call, apart: {first_mv:.2f}s)')
  both = collections.Counter(
    (a >= 1, b >= 1) for a, b in zip(rg, mv, strict=True)
  )
  print(
    f'agreement: both right {both[True, True]}, both wrong '
    f'{both[False, False]}, reasoning_gym only {both[True, False]}, '
    f'math_verify only {both[False, True]}'
  )
  shown = 0
  for text, a, b, want in zip(texts, rg, mv, truth, strict=True):
    if (a >= 1) != (b >= 1) and shown < 5:
      print(f'  rg={a:.2f} mv={b:.0f} answer={want!r} reply={text!r}')
      shown += 1


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument('--workdir', action='append', required=True)
  a = p.parse_args()
  steps, replies = [], []
  per_step = 0
  for w in map(pathlib.Path, a.workdir):
    step, per_step = run_figures(w)
    steps.append(step)
    for f in sorted((w / 'eval_samples').glob('step_*.jsonl')):
      replies += _rows(f)
  reward_cost(replies, statistics.median(steps), per_step)


if __name__ == '__main__':
  main()
