"""The eval harness in the loop, on a tiny from-scratch run (no step: the
initial weights, checkpoint 0 and the step-0 evaluation; 8 fake CPU
devices): named sets, the
sampled pass's pass@k against the closed form on its own JSONL, the JSONL
rows, and the greedy path unchanged by the sampled pass."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from jaxcorr.train.evals import samples_log
from jaxcorr.train.evals.config import EvalConfig
from jaxcorr.train.evals.sets import EvalSet
from jaxcorr.train.evaluation import Evaluator
from jaxcorr.train.loop import Trainer
from jaxcorr.train.rollouts.stage import RolloutStage
from jaxcorr.train.tracker import metrics, reduction
from tests.helpers.trainer_config import pulse_config

N = 4


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('eval_run')
  config = pulse_config(
    length_reward=True,
    train__num_steps=0,
    train__sft_steps=0,
    eval__samples=N,
    eval__k='1,2,4',
    eval__preset='liberal',
    eval__sets='{"add": {}, "mul": {"ops": "*", "max_operand": 9, '
    '"prompts": 4}}',
  )
  trainer = Trainer.from_config(config, str(workdir))
  last = trainer.train()
  yield trainer, last, workdir
  trainer.close()


def test_each_set_logs_greedy_and_sampled_metrics(run):
  _, last, workdir = run
  for name in ('add', 'mul'):
    for key in ('accuracy', 'reward_mean', 'response_length'):
      assert f'eval/{name}/{key}' in last
    for key in ('sampled_accuracy', 'pass@1', 'pass@2', 'pass@4', 'maj@4'):
      assert 0.0 <= last[f'eval/{name}/{key}'] <= 1.0
  assert 'eval/accuracy' not in last  # named sets only
  logged = metrics.read_metrics(str(workdir))
  assert logged[0]['step'] == 0 and 'eval/mul/pass@4' in logged[0]


def test_jsonl_rows_and_pass_at_k_from_them(run):
  trainer, last, workdir = run
  rows = samples_log.read(str(workdir / samples_log.DIRNAME), 0)
  sets = {s.name: s for s in trainer.evaluate.sets}
  assert [len(s.examples) for s in sets.values()] == [8, 4]
  for name, eval_set in sets.items():
    greedy = [r for r in rows if r['set'] == name and r['mode'] == 'greedy']
    sampled = [r for r in rows if r['set'] == name and r['mode'] == 'sampled']
    assert len(greedy) == len(eval_set.examples)
    assert len(sampled) == N * len(eval_set.examples)
    assert [r['sample'] for r in sampled[:N]] == list(range(N))
    ex = eval_set.examples[1]
    first = sampled[N]
    assert (first['prompt'], first['answer']) == (ex.prompt, ex.answer)
    assert first['prompt_index'] == 1 and first['step'] == 0
    # The weighted reward: exact match + 0.1 x the reply's length.
    for r in sampled:
      want = float(r['reply'].strip() == r['answer']) + 0.1 * len(r['reply'])
      assert r['reward'] == pytest.approx(want, rel=1e-6)
      assert r['score'] == float(r['reply'].strip() == r['answer'])
    want_acc = np.mean([r['score'] for r in greedy])
    assert last[f'eval/{name}/accuracy'] == pytest.approx(want_acc)
    for k in (1, 2, 4):
      per_prompt = []
      for p in range(len(eval_set.examples)):
        c = sum(r['score'] for r in sampled if r['prompt_index'] == p)
        per_prompt.append(1 - math.comb(N - int(c), k) / math.comb(N, k))
      got = last[f'eval/{name}/pass@{k}']
      assert got == pytest.approx(np.mean(per_prompt))


def _stable(m: dict) -> dict:
  return {k: v for k, v in m.items() if not k.startswith('time/')}


def test_greedy_path_is_unchanged_by_sets_and_sampling(run):
  trainer, last, _ = run
  stage = trainer.stage
  default_run = dataclasses.replace(trainer.run, eval=EvalConfig())
  default_stage = RolloutStage(
    default_run, stage.engine, stage.tokenizer, stage.scorer
  )
  add = trainer.evaluate.sets[0].examples
  greedy = Evaluator(default_stage, [EvalSet('', add)])(0)
  # The code path before the sampled pass existed: stage.evaluate at
  # seed step 10**9 + step.
  before = reduction.gather_processes(stage.evaluate(add, step=10**9))
  assert _stable(greedy) == _stable(before)
  assert set(_stable(greedy)) == {
    'eval/accuracy',
    'eval/reward_mean',
    'eval/response_length',
  }
  # The same greedy numbers as the run's step-0 eval of set 'add', which
  # ran beside a sampled pass.
  for key in ('accuracy', 'reward_mean', 'response_length'):
    assert last[f'eval/add/{key}'] == greedy[f'eval/{key}']


def test_long_sampled_pass_shows_progress_and_chunks_change_nothing(
  run, tmp_path, capsys
):
  """A long sampled pass printed nothing until it ended; decoded a few
  prompts at a time it prints a progress line per chunk, and its replies,
  rows and metrics are the run's own (the sampling keys follow the prompt's
  index in the set, not its chunk)."""
  trainer, last, workdir = run
  harness = trainer.evaluate
  chunked = Evaluator(
    harness.stage, harness.sets, samples_dir=str(tmp_path), chunk_rows=3 * N
  )
  capsys.readouterr()
  got = chunked(0)
  err = capsys.readouterr().err
  for line in ('eval/add/sampled prompts 3/8', 'eval/add/sampled prompts 8/8'):
    assert line in err
  assert 'eval/mul/sampled prompts 4/4' in err
  assert 's/prompt | ETA' in err  # from the second chunk on
  assert samples_log.read(str(tmp_path), 0) == samples_log.read(
    str(workdir / samples_log.DIRNAME), 0
  )
  assert _stable(got) == _stable({k: v for k, v in last.items() if k in got})
