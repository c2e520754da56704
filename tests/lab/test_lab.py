"""jaxcorr.lab: mismatch definitions, configs, summaries, tables and plots.

Everything here is fast except the `slow` test, which trains four
pulse-sized runs (~80 s) to check the two claims the grid's design rests
on: starting from a copied warm-up checkpoint is the same run as starting
from scratch, and `correction.enabled=False` trains like `disabled`.
"""

from __future__ import annotations

import json
import math

import pytest

from jaxcorr import lab
from jaxcorr.train import build

VOLATILE = ('time/', 'perf/')


# ------------------------------------------------------------ mismatches


def test_mismatch_definitions():
  assert lab.mismatch_overrides('none') == {}
  assert lab.mismatch_overrides('bf16') == {'rollout.engine_dtype': 'bfloat16'}
  assert lab.mismatch_overrides('int8') == {'rollout.simulated_quant': 'int8'}
  assert lab.mismatch_overrides('stale') == {
    'rollout.mode': 'async',
    'rollout.max_staleness': lab.DEFAULT_STALENESS,
  }
  assert lab.mismatch_overrides('stale7') == {
    'rollout.mode': 'async',
    'rollout.max_staleness': 7,
  }
  assert lab.mismatch_overrides('stale0')['rollout.max_staleness'] == 0
  combo = lab.mismatch_overrides('bf16+int8+stale2')
  assert combo == {
    'rollout.engine_dtype': 'bfloat16',
    'rollout.simulated_quant': 'int8',
    'rollout.mode': 'async',
    'rollout.max_staleness': 2,
  }
  severe = lab.mismatch_overrides('severe')
  assert severe['rollout.engine_dtype'] == 'bfloat16'
  assert severe['rollout.simulated_quant'] == 'int8'
  assert severe['rollout.mode'] == 'async'
  # Later parts win.
  assert lab.mismatch_overrides('stale4+stale1')['rollout.max_staleness'] == 1


def test_inflight_mismatch():
  """`inflight<k>`: the streaming producer with scheduled (reproducible)
  in-flight swaps, chunks short enough for rows to span several."""
  want = {
    'rollout.mode': 'stream',
    'rollout.max_staleness': 2,
    'rollout.queue_size': 2,
    'rollout.weight_sync': 'scheduled',
    'rollout.decode_chunk': lab.INFLIGHT_DECODE_CHUNK,
  }
  assert lab.mismatch_overrides('inflight2') == want
  assert (
    lab.make_config('off').rollout.max_new_tokens > lab.INFLIGHT_DECODE_CHUNK
  )
  one = lab.mismatch_overrides('inflight1')
  assert (one['rollout.max_staleness'], one['rollout.queue_size']) == (1, 1)
  # k = 0 still lets one batch be decoded (queue_size must be >= 1).
  assert lab.mismatch_overrides('inflight0')['rollout.queue_size'] == 1
  combo = lab.mismatch_overrides('bf16+inflight3')
  assert combo['rollout.engine_dtype'] == 'bfloat16'
  assert combo['rollout.max_staleness'] == 3
  # Later parts win: a fixed lag after the stream switches the mode back.
  assert lab.mismatch_overrides('inflight2+stale1')['rollout.mode'] == 'async'


@pytest.mark.parametrize(
  'name',
  [
    'bf17',
    'stalex',
    'stale-1',
    'int4',
    '',
    'inflight',
    'inflight-2',
    'inflightx',
    'flight2',
    '2',
  ],
)
def test_unknown_mismatch(name):
  with pytest.raises(ValueError, match='unknown mismatch') as e:
    lab.mismatch_overrides(name)
  # The message names the allowed forms.
  for form in ('none', 'bf16', 'stale<k>', 'inflight<k>', '+-joined'):
    assert form in str(e.value)


@pytest.mark.parametrize(
  'mismatch',
  [*lab.MISMATCHES, 'stale8', 'bf16+stale2', 'inflight2', 'bf16+inflight1'],
)
def test_every_mismatch_builds_a_valid_run(mismatch):
  """The trainer's start-up validation accepts every definition."""
  config = lab.make_config('disabled', mismatch)
  run = build.build(config)
  want = lab.mismatch_overrides(mismatch)
  if 'rollout.mode' in want:
    assert run.rollout.mode == want['rollout.mode']
    assert run.rollout.max_staleness == want['rollout.max_staleness']
  else:
    assert run.rollout.mode == 'sync'
  assert run.rollout.engine_dtype == want.get('rollout.engine_dtype', 'float32')
  assert run.rollout.simulated_quant == want.get(
    'rollout.simulated_quant', 'none'
  )


# --------------------------------------------------------------- configs


def test_make_config_presets_seeds_and_overrides():
  off = lab.make_config(lab.OFF)
  assert build.build(off).losses.correction is None
  c = lab.make_config(
    'slime_mis',
    'bf16',
    seed=3,
    optim__learning_rate=1e-3,
    **{'train.ppo_epochs': 2},
  )
  assert c.correction.veto_low == 1e-4  # the preset
  assert c.rollout.engine_dtype == 'bfloat16'
  assert (c.train.seed, c.model.init_seed) == (3, 3)
  assert c.optim.learning_rate == 1e-3
  assert c.train.ppo_epochs == 2
  assert c.train.loggers == 'jsonl'
  full = lab.make_config('disabled')
  small = lab.make_config('disabled', small=True)
  assert small.train.num_steps < full.train.num_steps
  assert small.model.hidden_size < full.model.hidden_size
  with pytest.raises(KeyError):
    lab.make_config('disabled', optim__learning_rat=1.0)


def test_env_small(monkeypatch):
  for value, want in [('1', True), ('yes', True), ('0', False), ('', False)]:
    monkeypatch.setenv('JAXCORR_SMALL', value)
    assert lab.env_small() is want
  monkeypatch.delenv('JAXCORR_SMALL')
  assert lab.env_small() is False


def test_sft_signature_ignores_what_sft_does_not_read():
  base = lab.sft_signature(lab.make_config('disabled', 'none'))
  same = [
    lab.make_config('slime_mis', 'severe'),
    lab.make_config(lab.OFF, 'stale8', optim__learning_rate=1e-2),
    lab.make_config('prime_dppo_kl', 'int8', train__num_steps=7),
  ]
  for c in same:
    assert lab.sft_signature(c) == base
  other = [
    lab.make_config('disabled', seed=1),
    lab.make_config('disabled', small=True),
    lab.make_config('disabled', train__sft_steps=10),
    lab.make_config('disabled', actor__kl_loss_coef=0.1),  # needs ref
  ]
  for c in other:
    assert lab.sft_signature(c) != base


# ------------------------------------------------------------- summaries


def _rows(accs, rewards, **series):
  """Synthetic metrics rows: eval at step 0 and every 5 steps."""
  rows = [{'step': 0, 'eval/accuracy': accs[0]}]
  for i, r in enumerate(rewards, 1):
    row = {'step': i, 'reward/mean': r, 'actor/loss': 0.1}
    for k, v in series.items():
      row[k] = v[i - 1]
    if i % 5 == 0:
      row['eval/accuracy'] = accs[i // 5]
    rows.append(row)
  return rows


def test_summarise():
  rewards = [0.1] * 2 + [0.5] * 6 + [0.8] * 2
  k3 = [1e-4] * 9 + [3e-3]
  # The signed k1 estimate falls while k3 rises: not what the lab reports.
  k1 = [1e-4] * 9 + [-2e-3]
  rej = [0.0] * 5 + [0.2] * 5
  ppl = [1.0] * 9 + [0.9]
  rows = _rows(
    [0.4, 0.7, 0.6],
    rewards,
    **{
      'rollout_corr/k3_kl': k3,
      'rollout_corr/kl': k1,
      'rollout_corr/rejected_token_fraction': rej,
      'rollout_corr/ppl_ratio': ppl,
    },
  )
  s = lab.summarise(rows)
  assert s['steps'] == 10
  assert (s['initial_accuracy'], s['final_accuracy']) == (0.4, 0.6)
  assert s['peak_accuracy'] == 0.7
  assert s['reward_first20'] == pytest.approx(0.1)  # first 2 of 10 steps
  assert s['reward_last20'] == pytest.approx(0.8)
  assert s['max_k3_kl'] == pytest.approx(3e-3)
  assert s['mean_k3_kl'] == pytest.approx(3.9e-4)
  assert not {'max_kl', 'mean_kl'} & set(s)  # the signed k1: curves only
  assert s['rejected_token_fraction'] == pytest.approx(0.1)
  assert s['max_ppl_dev'] == pytest.approx(0.1)
  assert s['mean_chi2_token'] is None  # not logged
  assert s['nonfinite'] == 0
  assert s['collapsed'] is False
  json.dumps(s)  # plain JSON types


def test_summarise_collapse_and_missing_metrics():
  # Accuracy falls 0.5 below its peak: collapsed.
  s = lab.summarise(_rows([0.5, 0.8, 0.3], [0.5] * 10))
  assert s['collapsed'] is True
  # Reward falls by more than COLLAPSE_DROP from the first to the last 20%.
  s = lab.summarise(_rows([0.5, 0.5, 0.5], [0.6] * 5 + [0.1] * 5))
  assert s['collapsed'] is True
  # A non-finite loss (read_metrics turns null into NaN).
  rows = _rows([0.5, 0.5, 0.5], [0.5] * 10)
  rows[3]['actor/loss'] = math.nan
  s = lab.summarise(rows)
  assert s['nonfinite'] == 1 and s['collapsed'] is True
  # `off` logs no rollout_corr/ metrics; no eval either here.
  s = lab.summarise([{'step': 1, 'reward/mean': 0.5, 'actor/loss': 0.0}])
  assert s['max_k3_kl'] is None and s['mean_k3_kl'] is None
  assert s['rejected_token_fraction'] is None
  assert s['final_accuracy'] is None and s['collapsed'] is False
  assert lab.summarise([])['steps'] == 0


def _record(preset, mismatch, seed, final):
  rows = _rows(
    [0.5, 0.6, final],
    [0.3 + 0.01 * i for i in range(10)],
    **{
      'rollout_corr/kl': [-1e-3] * 10,
      'rollout_corr/chi2_token': [0.01] * 10,
      'rollout_corr/k3_kl': [2e-3 * (seed + 1)] * 10,
      'rollout_corr/log_ppl_abs_diff': [0.01] * 10,
      'rollout_corr/ppl_ratio': [1.01] * 10,
      'rollout_corr/rejected_token_fraction': [0.05] * 10,
    },
  )
  return {
    'preset': preset,
    'mismatch': mismatch,
    'seed': seed,
    'summary': lab.summarise(rows),
    'curves': lab.curves(rows),
    'wall_s': 1.0,
  }


RECORDS = [
  _record(p, m, s, 0.5 + 0.1 * s - 0.2 * ((p, m) == ('disabled', 'stale4')))
  for m in ('none', 'stale4')
  for p in ('disabled', 'slime_mis')
  for s in (0, 1)
]


def test_aggregate_and_table():
  rows = lab.aggregate(RECORDS)
  assert len(rows) == 4
  r = rows[0]
  assert (r['mismatch'], r['preset'], r['seeds']) == (
    'none',
    'disabled',
    [0, 1],
  )
  assert r['final_accuracy'] == pytest.approx(0.55)
  assert r['final_accuracy_per_seed'] == [0.5, 0.6]
  assert r['max_k3_kl'] == pytest.approx(3e-3)
  per_run = lab.markdown_table(RECORDS).strip().splitlines()
  assert len(per_run) == 2 + 8
  assert '| max k3 |' in per_run[0] and 'kl' not in per_run[0]
  # The gap column is k3 (seed 1: 4e-3), not the signed k1 (-1e-3).
  assert '| 0.385 | 4.0e-03 | 1.0e-02 |' in per_run[3]
  # Δ base: against the same seed's disabled@none run.
  for start in (
    '| none | `disabled` | 1 | 0.500 | 0.600 | +0.000 |',
    '| stale4 | `disabled` | 1 | 0.500 | 0.400 | -0.200 |',
    '| stale4 | `slime_mis` | 0 | 0.500 | 0.500 | +0.000 |',
  ):
    assert any(line.startswith(start) for line in per_run), start
  means = lab.markdown_table(RECORDS, per_seed=False)
  assert len(means.strip().splitlines()) == 2 + 4
  assert '`slime_mis` | 0,1 | 0.500 | 0.550 | (0.500, 0.600)' in means
  assert lab.baseline_accuracy(RECORDS) == {0: 0.5, 1: 0.6}


def test_summarise_staleness():
  """The async axis: staleness and version mixing per run (None where a
  run logs none)."""
  rows = _rows(
    [0.5, 0.5, 0.5],
    [0.5] * 10,
    **{
      'rollout/staleness_mean': [0.0] * 5 + [1.0] * 5,
      'rollout/staleness_max': [0.0] * 5 + [2.0] * 4 + [1.0],
      'rollout/mixed_version_fraction': [0.0] * 8 + [0.5, 0.3],
    },
  )
  s = lab.summarise(rows)
  assert s['mean_staleness'] == pytest.approx(0.5)
  assert s['max_staleness'] == 2.0
  assert s['mixed_version_fraction'] == pytest.approx(0.08)
  assert 'rollout/mixed_version_fraction' in lab.curves(rows)
  s = lab.summarise(_rows([0.5, 0.5, 0.5], [0.5] * 10))
  assert s['mean_staleness'] is None and s['max_staleness'] is None
  assert s['mixed_version_fraction'] is None


def test_spread_table():
  lines = lab.spread_table(RECORDS).strip().splitlines()
  assert len(lines) == 2 + 4
  # Mean ± sample sd over seeds 0 and 1 (final 0.5, 0.6); Δ base per seed.
  assert lines[2].startswith(
    '| none | `disabled` | 0,1 | 0.550 ± 0.071 | 0.000 ± 0.000 |'
  )
  assert lines[3].startswith(
    '| none | `slime_mis` | 0,1 | 0.550 ± 0.071 | 0.000 ± 0.000 |'
  )
  stale = next(line for line in lines if '| stale4 | `disabled`' in line)
  assert '| 0.350 ± 0.071 | -0.200 ± 0.000 |' in stale
  # Mean k3; no staleness logged; seed 0 fell 0.3 below its peak.
  assert '| mean k3 |' in lines[0]
  assert '| 3.0e-03 | – | – | 1/2 |' in stale
  # One seed: no sd; a seed without its baseline run: no Δ base.
  one = [r for r in RECORDS if r['seed'] == 1 and r['preset'] == 'slime_mis']
  lines = lab.spread_table(one).strip().splitlines()
  assert lines[2].startswith('| none | `slime_mis` | 1 | 0.600 | – |')
  # Staleness: mean of the runs' means, the largest max, mixed rows.
  rec = dict(RECORDS[0])
  rec['summary'] = {
    **rec['summary'],
    'mean_staleness': 1.25,
    'max_staleness': 2.0,
    'mixed_version_fraction': 0.1,
  }
  line = lab.spread_table([rec]).strip().splitlines()[2]
  assert '| 1.25 (2) | 0.10 | 0/1 |' in line


def test_write_and_load_results(tmp_path):
  import matplotlib

  matplotlib.use('Agg')
  plan = [lab.Grid(('disabled', 'slime_mis'), ('none', 'stale4'), (0, 1))]
  lab.write_results(RECORDS, str(tmp_path), plan=plan)
  assert lab.load_results(str(tmp_path)) == json.loads(
    json.dumps(RECORDS)
  )  # tuples -> lists
  assert 'Means ± sample standard deviation' in (
    (tmp_path / 'results.md').read_text()
  )
  for name in (
    'results.md',
    'baseline_seed0.png',
    'diagnostics_seed1.png',
    'presets_none_seed0.png',
    'presets_stale4_seed1.png',
    'rejected_stale4_seed0.png',
    'final_accuracy.png',
  ):
    assert (tmp_path / name).stat().st_size > 0, name


def test_grid_tags_and_runs():
  g = lab.Grid(('a', 'b'), ('none',), (0, 1))
  assert g.runs() == [
    ('a', 'none', 0),
    ('b', 'none', 0),
    ('a', 'none', 1),
    ('b', 'none', 1),
  ]
  assert g.tag() == 'full'
  assert lab.Grid((), (), small=True).tag() == 'small'
  t1 = lab.Grid((), (), overrides={'optim.learning_rate': 1e-3}).tag()
  t2 = lab.Grid((), (), overrides={'optim__learning_rate': 1e-3}).tag()
  assert t1 == t2 != 'full'
  for plan in (lab.default_plan(True), lab.default_plan(False)):
    for grid in plan:
      for preset, mismatch, _ in grid.runs():
        lab.make_config(preset, mismatch)  # every name is valid


# ------------------------------------------------------------- training


def _stable(rows):
  return [
    {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows
  ]


@pytest.mark.slow
def test_sft_copy_equals_scratch_and_off_equals_disabled(tmp_path):
  """Two claims the grid rests on, on pulse-sized runs.

  A run started from the shared warm-up checkpoint is the run from scratch,
  metric for metric. And `correction.enabled=False` makes the same updates
  as the `disabled` preset (one update per batch: π_old comes from the
  trainer either way); only the `rollout_corr/` diagnostics differ, which
  is why the full grid runs `disabled` alone.
  """
  kw = dict(seed=0, small=False, train__num_steps=2, train__eval_every=0)
  sft = str(tmp_path / 'sft')
  scratch = lab.run_experiment(
    'pulse+disabled', 'bf16', workdir=str(tmp_path / 'a'), **kw
  )
  shared = lab.run_experiment(
    'pulse+disabled', 'bf16', workdir=str(tmp_path / 'b'), sft_cache=sft, **kw
  )
  assert (tmp_path / 'b' / 'checkpoints' / '2').is_dir()
  assert [r['step'] for r in shared] == [1, 2]
  assert _stable(scratch) == _stable(shared)
  # A finished run directory is read back, not rerun.
  again = lab.run_experiment(
    'pulse+disabled', 'bf16', workdir=str(tmp_path / 'b'), **kw
  )
  assert again == shared

  off = lab.run_experiment(
    'pulse+off', 'bf16', workdir=str(tmp_path / 'off'), sft_cache=sft, **kw
  )
  assert not any(k.startswith('rollout_corr/') for r in off for k in r)
  assert any(k.startswith('rollout_corr/') for r in shared for k in r)
  strip = lambda rows: [  # noqa: E731
    {k: v for k, v in r.items() if not k.startswith('rollout_corr/')}
    for r in _stable(rows)
  ]
  assert strip(off) == strip(shared)


def test_tables_of_results_stored_before_mean_k3(tmp_path):
  """A results.json written before the summaries had `mean_k3_kl` (the
  docs' grids): `load_results` takes it from the stored k3 curve, and
  `write_tables` (`python -m jaxcorr.lab --tables_only`) rewrites
  results.md from it without running anything."""
  plan = [lab.Grid(('disabled', 'slime_mis'), ('none', 'stale4'), (0, 1))]
  lab.write_results(RECORDS, str(tmp_path), plan=plan, plots=False)
  path = tmp_path / 'results.json'
  stored = json.loads(path.read_text())
  for r in stored['runs']:
    del r['summary']['mean_k3_kl']
  path.write_text(json.dumps(stored))
  (tmp_path / 'results.md').unlink()
  records = lab.load_results(str(tmp_path))
  assert [r['summary']['mean_k3_kl'] for r in records] == [
    pytest.approx(2e-3 * (r['seed'] + 1)) for r in RECORDS
  ]
  lab.write_tables(records, str(tmp_path))
  fresh = tmp_path / 'fresh'
  lab.write_results(RECORDS, str(fresh), plan=plan, plots=False)
  text = (tmp_path / 'results.md').read_text()
  assert text == (fresh / 'results.md').read_text()
  assert '| mean k3 |' in text
