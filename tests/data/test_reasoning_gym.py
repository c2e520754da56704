"""`config.data.source='reasoning_gym'`: rows a pure function of the seed,
resume exact through the loader's state, the task's own `score_answer` as
the reward, start-up errors for a bad task."""

from __future__ import annotations

import pytest
import reasoning_gym

from jaxcorr import rewards as R
from jaxcorr.data import prompts
from jaxcorr.data import reasoning_gym as rg
from jaxcorr.train import build
from tests.helpers.trainer_config import pulse_config

CFG = {
  'source': 'reasoning_gym',
  'task': 'chain_sum',
  'task_config': '{"min_terms": 2, "max_terms": 3}',
  'seed': 7,
  'num_examples': 200,
  'eval_examples': 16,
}
MIX = dict(CFG, task='chain_sum:2,leg_counting:1', task_config='')


@pytest.mark.parametrize('cfg', [CFG, MIX], ids=['task', 'mix'])
def test_rows_are_a_function_of_the_seed(cfg):
  a, b = prompts.make_source(cfg), prompts.make_source(dict(cfg))
  assert [a[i] for i in range(20)] == [b[i] for i in range(20)]
  assert a[-1] == a[len(a) - 1]
  other = prompts.make_source(dict(cfg, seed=8))
  assert [a[i].prompt for i in range(20)] != [
    other[i].prompt for i in range(20)
  ]


def test_rows_are_the_generators_own():
  src = prompts.make_source(CFG)
  own = reasoning_gym.create_dataset(
    'chain_sum', seed=7, size=200, min_terms=2, max_terms=3
  )
  assert [src[i].prompt for i in range(10)] == [
    own[i]['question'] for i in range(10)
  ]
  text = prompts.format_prompt('Q: {prompt}\nA:', src[3])
  assert text == f'Q: {own[3]["question"]}\nA:'


def test_eval_rows_come_from_another_seed():
  train, ev = prompts.make_source(CFG), prompts.make_eval_source(CFG)
  assert len(ev) == 16
  assert ev.seed == CFG['seed'] + CFG['num_examples']
  # The per-item seeds seed + i never meet: no evaluation prompt is a
  # training one (checked on the whole training set).
  assert not {ev[i].prompt for i in range(16)} & {
    train[i].prompt for i in range(len(train))
  }
  assert prompts.make_eval_source(dict(CFG, eval_examples=0)) is None


def test_resume_through_the_loader_state():
  def loader():
    return prompts.PromptLoader(
      prompts.make_source(MIX), batch_size=6, seed=3, shuffle=True
    )

  run = loader()
  for _ in range(40):  # past an epoch of 200 rows
    run.next_batch()
  state = run.state()
  expected = [run.next_batch() for _ in range(5)]
  resumed = loader()
  resumed.restore(state)
  assert [resumed.next_batch() for _ in range(5)] == expected


def test_reward_is_the_tasks_own_score_answer():
  src = prompts.make_source(MIX)
  rows = [src[i] for i in range(8)]
  entries = [src.entry(i) for i in range(8)]
  replies, expected = [], []
  for ex, entry in zip(rows, entries):
    ds, same = rg.entry(ex.answer)
    assert same == entry
    for reply in (
      f'thinking... <answer>{entry["answer"]}</answer>',
      f'<answer>{entry["answer"]}1</answer>',
      entry['answer'],  # no <answer> tag: reasoning-gym reads None
    ):
      replies.append(reply)
      expected.append(ds.score_answer(rg.extract(reply), entry))
  scorer = R.RewardScorer(R.parse_spec('reasoning_gym'), timeout_s=30)
  try:
    rewards, metrics = scorer.score(
      replies, [ex.answer for ex in rows for _ in range(3)]
    )
  finally:
    scorer.close()
  assert rewards.tolist() == pytest.approx(expected)
  assert rewards[0::3].tolist() == [1.0] * 8
  assert rewards[2::3].tolist() == [0.0] * 8
  assert metrics['reward/failures'] == 0


def test_the_reward_refuses_rows_of_other_sources():
  with pytest.raises(ValueError, match="source='reasoning_gym'"):
    rg.entry('42')


def _run(**overrides):
  values = {'data__source': 'reasoning_gym'}
  values['reward__functions'] = 'reasoning_gym'
  values['train__sft_steps'] = 0
  return pulse_config(**{**values, **overrides})


def test_bad_task_name_is_a_start_up_error():
  with pytest.raises(ValueError, match=r'config\.data\.task: unknown') as e:
    build.build(_run(data__task='chain_summ'))
  assert 'chain_sum' in str(e.value)
  with pytest.raises(ValueError, match=r'config\.data\.task'):
    build.build(_run(data__task=''))
  with pytest.raises(ValueError, match=r'config\.data\.task: invalid entry'):
    build.build(_run(data__task='chain_sum:-1'))


def test_other_start_up_errors():
  with pytest.raises(ValueError, match=r'config\.data\.task_config'):
    build.build(_run(data__task='chain_sum', data__task_config='{"x": 1}'))
  with pytest.raises(ValueError, match=r'config\.data\.task_config: invalid'):
    build.build(_run(data__task='chain_sum', data__task_config='{'))
  with pytest.raises(ValueError, match='math_answer'):
    build.build(_run(data__task='chain_sum', reward__functions='math_answer'))
  with pytest.raises(ValueError, match=r'config\.train\.sft_steps'):
    build.build(_run(data__task='chain_sum', train__sft_steps=2))
  run = build.build(_run(data__task='chain_sum:1,leg_counting:2'))
  assert run.data.source == 'reasoning_gym'
