"""`rollout.exact` through the whole trainer (configs/arith_tiny.py's pulse,
8 fake CPU devices): at staleness 0 the engine's μ and the trainer's π_old
agree bit for bit, so every `rollout_corr/` gap metric reads exactly 0 (the
importance weights exactly 1), packed update rows or not."""

from __future__ import annotations

import json

from configs import arith_tool
from jaxcorr.train.loop import Trainer
from tests.helpers.trainer_config import pulse_config

# Differences of π_old and μ: exactly 0 when they are equal.
ZERO = (
  'kl',
  'k3_kl',
  'log_ppl_diff',
  'log_ppl_abs_diff',
  'log_ppl_diff_max',
  'log_ppl_diff_min',
  'chi2_token',
  'chi2_seq',
  'rejected_token_fraction',
  'rejected_seq_fraction',
)
# Ratios π_old / μ: exactly 1.
ONE = ('ppl_ratio', 'rollout_is_mean', 'rollout_is_max', 'rollout_is_min')


def test_exact_run_has_no_gap_at_staleness_0(tmp_path):
  """Packed update rows: π_old is scored over the batch's own rows all
  the same (tests/rollout/test_exact.py covers the scoring itself)."""
  config = pulse_config(
    'decoupled_token_is',
    length_reward=True,
    rollout__exact=True,
    train__num_steps=2,
    train__eval_at_start=False,
    train__packing=True,
  )
  trainer = Trainer.from_config(config, str(tmp_path), config_name='test')
  trainer.train()
  with open(tmp_path / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f]
  assert [r['step'] for r in rows] == [1, 2]
  for r in rows:
    corr = {k[len('rollout_corr/') :]: v for k, v in r.items() if 'corr/' in k}
    for name in ZERO:
      assert corr[name] == 0.0, (name, corr[name])
    for name in ONE:
      assert corr[name] == 1.0, (name, corr[name])
    assert corr['training_log_ppl'] == corr['rollout_log_ppl']
    assert r['batch/valid_tokens'] > 0


def test_exact_multi_turn_run_has_no_gap(tmp_path):
  """configs/arith_tool.py (calculator turns, each continued on its slot's
  KV cache): the environment's tokens are prefilled onto the cache by the
  exact forward too, so the agent tokens' μ is π_old bit for bit."""
  config = arith_tool.get_config('pulse+decoupled_token_is')
  config.rollout.exact = True
  config.train.num_steps = 1
  config.train.eval_every = 0
  trainer = Trainer.from_config(config, str(tmp_path), config_name='test')
  trainer.train()
  with open(tmp_path / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f if '"step": 0' not in line]
  assert rows and all(r['agent/env_tokens_mean'] > 0 for r in rows)
  for r in rows:
    assert r['rollout_corr/kl'] == 0.0 and r['rollout_corr/k3_kl'] == 0.0
    assert r['rollout_corr/log_ppl_abs_diff'] == 0.0
