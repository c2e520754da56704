"""configs/base.py, configs/presets.py, jaxcorr.config.convert and the loss
sections of jaxcorr.train.build."""

import ast
import dataclasses
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from ml_collections import ConfigDict, config_flags

from configs import base, presets
from jaxcorr.config import fields
from jaxcorr.losses import correction as corr_lib
from jaxcorr.losses import objective as obj
from jaxcorr.losses.objective_config import ActorLossConfig
from jaxcorr.train import build
from tests.helpers import golden_data as gd

BASE_FILE = str(pathlib.Path(base.__file__))
C = corr_lib.CorrectionConfig
A = ActorLossConfig
GEO = dict(rs=('seq_mean_k1',), rs_bounds=((0.999, 1.001),))
K3 = dict(rs=('seq_mean_k3',), rs_bounds=((None, 0.01),))
PG = dict(mode='bypass', bypass_loss='reinforce')

# docs/math/correction.md §6, transcribed independently of presets.py:
# name -> (CorrectionConfig, ActorLossConfig overrides).
TABLE = {
  'disabled': (C(), {}),
  'decoupled_token_is': (C(is_level='token', is_upper=2.0), {}),
  'decoupled_seq_is': (C(is_level='sequence', is_upper=2.0), {}),
  'decoupled_token_icepop': (
    C(is_level='token', is_mode='mask', is_lower=0.5, is_upper=5.0),
    {},
  ),
  'decoupled_seq_is_rs': (
    C(is_level='sequence', rs=('seq_sum_k1',), rs_bounds=((0.5, 2.0),)),
    {},
  ),
  'decoupled_geo_rs': (C(**GEO), {}),
  'decoupled_geo_rs_seq_tis': (C(is_level='sequence', **GEO), {}),
  'decoupled_geo_rs_token_tis': (C(is_level='token', **GEO), {}),
  'decoupled_k3_rs': (C(**K3), {}),
  'decoupled_k3_rs_seq_tis': (C(is_level='sequence', **K3), {}),
  'decoupled_k3_rs_token_tis': (C(is_level='token', **K3), {}),
  'bypass_ppo_clip': (C(mode='bypass'), {}),
  'bypass_ppo_clip_geo_rs': (C(mode='bypass', **GEO), {}),
  'bypass_ppo_clip_k3_rs': (C(mode='bypass', **K3), {}),
  'bypass_pg_is': (
    C(is_level='sequence', is_upper=2.0, **PG),
    {'policy_loss': 'reinforce'},
  ),
  'bypass_pg_token_icepop': (
    C(is_level='token', is_mode='mask', is_lower=0.5, is_upper=5.0, **PG),
    {'policy_loss': 'reinforce'},
  ),
  'bypass_pg_geo_rs': (C(**GEO, **PG), {'policy_loss': 'reinforce'}),
  'bypass_pg_geo_rs_seq_tis': (
    C(is_level='sequence', **GEO, **PG),
    {'policy_loss': 'reinforce'},
  ),
  'bypass_pg_geo_rs_token_tis': (
    C(is_level='token', **GEO, **PG),
    {'policy_loss': 'reinforce'},
  ),
  'skyrl_token_tis': (C(is_level='token', is_upper=2.0), {}),
  'skyrl_seq_tis': (C(is_level='sequence', is_upper=5.0), {}),
  'skyrl_geo_mask': (
    C(rs=('seq_mean_k1',), rs_bounds=((0.99, 1.01),)),
    {},
  ),
  'skyrl_outlier_mask': (C(veto_low=1e-4, veto_high=100.0), {}),
  'slime_mis': (
    C(
      is_level='token',
      is_mode='truncate',
      is_upper=2.0,
      is_lower=0.5,
      rs=('token_k1',),
      rs_bounds=((0.5, 2.0),),
      veto_low=1e-4,
      is_batch_normalize=True,
    ),
    {},
  ),
  'prime_dppo_kl': (
    C(mode='bypass'),
    {'policy_loss': 'prime', 'agg': 'token_mean'},
  ),
  'decoupled_m2po': (C(), {'policy_loss': 'm2po'}),
  'decoupled_topr': (C(), {'policy_loss': 'topr'}),
  'bypass_cispo_rollout': (C(mode='bypass'), {'policy_loss': 'cispo_rollout'}),
  'bypass_m2po': (C(mode='bypass'), {'policy_loss': 'm2po'}),
  'nemo_seq_logprob_error': (
    C(rs=('seq_mean_mpe',), rs_bounds=((None, 2.0),)),
    {},
  ),
  'decoupled_vcpo': (
    C(is_level='token', is_upper=2.0),
    {'ess_scaling': True, 'grad_baselining': True},
  ),
}
ROLLOUT_KL = {'rollout_kl_type': 'k2', 'rollout_kl_coef': 2e-3}


def _flat_keys(cd, prefix=''):
  out = set()
  for k, v in cd.items():
    if isinstance(v, ConfigDict):
      out |= _flat_keys(v, f'{prefix}{k}.')
    else:
      out.add(prefix + k)
  return out


def _base_keys():
  return _flat_keys(base.get_config())


def _build(name=None, **overrides):
  cfg = base.get_config(name)
  for path, value in overrides.items():
    section, field = path.split('__')
    cfg[section][field] = value
  return build.losses(cfg)


# ------------------------------------------------------------------ presets


def test_table_covers_every_preset():
  assert set(TABLE) == set(presets.PRESETS)
  assert len(presets.PRESETS) == 31
  # The first 19 carry verl's names (golden meta records verl's list).
  verl_names = gd.load('verl').meta['presets']
  assert len(verl_names) == 19
  assert set(verl_names) == set(list(presets.PRESETS)[:19])


@pytest.mark.parametrize('name', list(TABLE), ids=lambda n: f'preset={n}')
def test_preset_builds_table_values(name):
  want_corr, actor_kw = TABLE[name]
  built = _build(name)
  assert built.correction == want_corr
  assert built.actor == A(**actor_kw)
  assert hash(built.correction) == hash(want_corr)


@pytest.mark.parametrize('name', presets.names(), ids=lambda n: f'preset={n}')
def test_every_name_has_exactly_the_base_key_set(name):
  cfg = base.get_config(name)
  assert _flat_keys(cfg) == _base_keys()
  build.losses(cfg)


@pytest.mark.parametrize('name', list(TABLE), ids=lambda n: f'preset={n}')
def test_rollout_kl_suffix_composes(name):
  want_corr, actor_kw = TABLE[name]
  built = _build(name + '+rollout_kl')
  assert built.correction == want_corr
  assert built.actor == A(**actor_kw, **ROLLOUT_KL)


def test_plain_rollout_kl_and_default_name():
  assert _build('rollout_kl') == _build('disabled+rollout_kl')
  assert _build('rollout_kl').actor.rollout_kl_coef == 2e-3
  assert _build(None) == _build('disabled') == _build('') == _build(' ')
  default = _build()
  assert default.correction == C() and default.actor == A()


def test_disabled_is_not_none():
  """'disabled' logs diagnostics (needs rollout logp); enabled=False is off."""
  assert _build('disabled').correction is not None
  with pytest.raises(ValueError, match='does not report log-probs'):
    build.losses(base.get_config('disabled'), rollout_logp_available=False)
  off = base.get_config('disabled')
  off.correction.enabled = False
  built = build.losses(off, rollout_logp_available=False)
  assert built.correction is None
  off_kl = base.get_config('rollout_kl')
  off_kl.correction.enabled = False
  with pytest.raises(ValueError, match=r'rollout_kl_coef=0\.002 needs rollout'):
    build.losses(off_kl, rollout_logp_available=False)


@pytest.mark.parametrize(
  'name', ['decoupled_tokn_is', 'ppo', 'disabled+rollout_kl+rollout_kl']
)
def test_unknown_preset_lists_valid_ones(name):
  with pytest.raises(ValueError, match='Valid presets: disabled, decoupled_'):
    base.get_config(name)
  with pytest.raises(ValueError) as e:
    base.get_config(name)
  for valid in ('slime_mis', 'prime_dppo_kl', 'bypass_pg_geo_rs_token_tis'):
    assert valid in str(e.value)


def test_unknown_preset_suggests_closest():
  with pytest.raises(ValueError, match="Did you mean 'decoupled_token_is'"):
    base.get_config('decoupled_tokn_is')


@pytest.mark.parametrize(
  'ghost,geo',
  [
    ('decoupled_k1_rs', 'decoupled_geo_rs'),
    ('bypass_ppo_clip_k1_rs', 'bypass_ppo_clip_geo_rs'),
    ('bypass_pg_k1_rs', 'bypass_pg_geo_rs'),
    ('bypass_pg_k1_rs+rollout_kl', 'bypass_pg_geo_rs'),
  ],
)
def test_ghost_presets_hint_geo_rs(ghost, geo):
  with pytest.raises(ValueError, match=rf"does not exist.*use '{geo}'"):
    base.get_config(ghost)


def test_presets_never_add_keys():
  cfg = base.get_config()
  with pytest.raises(KeyError, match='no field'):
    presets.apply_overrides(cfg, {'correction.is_lowr': 0.5})
  with pytest.raises(KeyError, match='no section'):
    presets.apply_overrides(cfg, {'loss.policy_loss': 'gspo'})
  unlocked = ConfigDict({'correction': {'mode': 'decoupled'}})
  with pytest.raises(KeyError):  # even on an unlocked config
    presets.apply_overrides(unlocked, {'correction.rs': 'token_k1'})
  for name, values in presets.PRESETS.items():
    assert set(values) <= _base_keys(), name


# -------------------------------------------------------- invalid combos


INVALID = [
  # RS criterion without bounds.
  ('disabled', {'correction__rs': 'token_k1'}, r'rs_bounds.*allowed'),
  # A k2 bound written as 'lo_up'.
  (
    'disabled',
    {'correction__rs': 'token_k2', 'correction__rs_bounds': '0.5_2.0'},
    r"rs_bounds\[token_k2\].*'lo_up'.*allowed: a single number",
  ),
  ('disabled', {'correction__rs_bounds': '0.01'}, r'rs_bounds.*allowed'),
  ('disabled', {'correction__rs': 'token'}, r"rs.*use 'token_k1'.*allowed"),
  ('disabled', {'correction__rs': 'k1_token'}, r'rs.*allowed: token_k1'),
  ('disabled', {'correction__rs_bounds': 'a_b'}, r'rs_bounds.*allowed'),
  ('disabled', {'correction__is_mode': 'cap'}, r'is_mode.*allowed'),
  ('disabled', {'correction__mode': 'hybrid'}, r"mode.*'decoupled'"),
  ('disabled', {'correction__is_level': 'tok'}, r'is_level.*allowed'),
  ('decoupled_token_is', {'correction__is_lower': 3.0}, r'is_lower.*allowed'),
  ('disabled', {'correction__veto_low': 2.0}, r'veto_low.*allowed'),
  ('disabled', {'correction__veto_high': 0.5}, r'veto_high.*allowed'),
  (
    'disabled',
    {'correction__is_batch_normalize': True},
    r'is_batch_normalize.*allowed',
  ),
  (
    'disabled',
    {'correction__bypass_loss': 'reinforce'},
    r"bypass_loss.*allowed: 'ppo_clip' in decoupled",
  ),
  # Unknown estimators, aggregation modes, losses, knob values.
  ('disabled', {'actor__kl_loss_type': 'k4'}, r"kl_loss_type='k4'.*allowed"),
  ('disabled', {'actor__rollout_kl_type': 'full'}, r'rollout_kl_type.*allowed'),
  ('disabled', {'actor__agg': 'mean'}, r"agg='mean'.*allowed"),
  ('disabled', {'actor__policy_loss': 'ppo'}, r"policy_loss='ppo'.*allowed"),
  ('disabled', {'actor__clip_ratio_c': 0.5}, r'clip_ratio_c.*allowed'),
  ('disabled', {'actor__policy_loss': 'dro'}, r'dro_beta.*allowed'),
  ('disabled', {'actor__kl_loss_coef': -1.0}, r'kl_loss_coef.*allowed'),
  # Combination checks.
  (
    'bypass_pg_is',
    {'actor__policy_loss': 'vanilla'},
    r"actor.policy_loss='vanilla' is not allowed.*allowed: reinforce",
  ),
  (
    'bypass_ppo_clip',
    {'actor__policy_loss': 'reinforce'},
    r"actor.policy_loss='reinforce' is not allowed.*allowed: cispo",
  ),
  (
    'decoupled_token_is',
    {'actor__policy_loss': 'rollout_is'},
    r"correction.is_level='token'.*allowed: is_level=None",
  ),
  (
    'prime_dppo_kl',
    {'correction__is_level': 'sequence'},
    r"correction.is_level='sequence'.*policy_loss='prime'",
  ),
]


@pytest.mark.parametrize(
  'name,overrides,match',
  INVALID,
  ids=[f'{next(iter(o))}={n}' for n, o, _ in INVALID],
)
def test_invalid_combinations_fail_at_build(name, overrides, match):
  with pytest.raises(ValueError, match=match) as e:
    _build(name, **overrides)
  msg = str(e.value)
  field = next(iter(overrides)).split('__')[1]
  assert field in msg or 'rs_bounds' in msg  # the field is named
  assert 'allowed' in msg


def test_build_messages_name_the_section():
  # The full config path of the field leads the message.
  with pytest.raises(ValueError, match=r'^config\.correction\.is_mode: '):
    _build('disabled', correction__is_mode='cap')
  with pytest.raises(ValueError, match=r'^config\.actor[.:].*agg'):
    _build('disabled', actor__agg='mean')


def test_bypass_reinforce_without_is_or_rs_is_allowed():
  """Decision: plain REINFORCE against μ with diagnostics only is valid."""
  built = _build(
    'bypass_pg_is', correction__is_level=None, correction__is_upper=2.0
  )
  assert built.correction == C(**PG)
  assert built.actor.policy_loss == 'reinforce'
  mask = np.array([[True, True, False], [True, False, False]])
  lp = jnp.array([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
  adv = jnp.array([[1.0, -1.0, 0.0], [2.0, 0.0, 0.0]])
  loss, met = jax.jit(
    lambda x: obj.actor_objective(
      built.actor,
      built.correction,
      logp=x,
      advantages=adv,
      mask=mask,
      rollout_logp=x - 0.1,
    )
  )(lp)
  np.testing.assert_allclose(loss, -(-1.0 + 2.0 - 1.0) / 3, rtol=1e-6)
  assert 'rollout_corr/kl' in met and 'rollout_corr/rollout_is_mean' not in met


def test_lock_config_typo_fails():
  cfg = base.get_config('slime_mis')
  with pytest.raises(AttributeError, match='is_lower'):
    cfg.correction.is_lowr = 0.5
  with pytest.raises(AttributeError):
    cfg.loss = ConfigDict()
  with pytest.raises(TypeError):  # typed fields keep their type
    cfg.correction.is_upper = 'two'
  cfg.correction.is_upper = 3  # an int is a valid float
  assert build.losses(cfg).correction.is_upper == 3.0


def test_converter_rejects_unknown_fields():
  section = base.correction_section().to_dict()
  section['is_lowr'] = 0.5
  with pytest.raises(ValueError, match=r'unknown field\(s\) is_lowr; allowed'):
    build.correction(ConfigDict({'correction': section}))
  actor = dict(base.actor_section().to_dict(), use_kl_loss=True)
  with pytest.raises(ValueError, match='use_kl_loss'):
    build.actor(ConfigDict({'actor': actor}))


def test_converter_accepts_sections_and_field_dicts():
  cfg = base.get_config('slime_mis')
  assert build.correction(cfg.correction) == TABLE['slime_mis'][0]
  assert build.correction({'is_level': 'token'}) == C(is_level='token')
  assert build.actor(cfg.actor) == A()


def test_task_config_pattern():
  """A task config: base_config() + own fields + preset + lock."""
  cfg = base.base_config()
  cfg.actor.kl_loss_coef = 1e-3  # a task default ...
  presets.apply_preset(cfg, 'decoupled_token_is+rollout_kl')
  cfg.lock()
  built = build.losses(cfg)
  assert built.actor == A(kl_loss_coef=1e-3, **ROLLOUT_KL)
  assert built.correction == TABLE['decoupled_token_is'][0]
  assert _flat_keys(cfg) == _base_keys()


def test_base_sections_cover_every_dataclass_field():
  cfg = base.get_config()
  corr_fields = {f.name for f in dataclasses.fields(C)}
  assert set(cfg.correction) == corr_fields | {'enabled'}
  assert set(cfg.actor) == {f.name for f in dataclasses.fields(A)}
  # Defaults agree with the dataclasses (rs strings '' = ()).
  built = build.losses(cfg)
  assert built.correction == C() and built.actor == A()


def test_base_fields_are_documented():
  """Every correction and actor field carries its doc, declared once on its
  dataclass (the sections of base.py are derived from them)."""
  for cls in (C, A):
    docs = fields.docs(cls)
    assert set(docs) == {f.name for f in dataclasses.fields(cls)}
    for name, doc in docs.items():
      assert len(doc) > 10, (cls.__name__, name)


# --------------------------------------------------------------- CLI flags


def _parse(*args):
  argv = ['prog', *args]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file('config', flag_values=fv, sys_argv=argv)
  fv(argv)
  return fv.config


def test_cli_preset_and_overrides():
  cfg = _parse(
    f'--config={BASE_FILE}:decoupled_token_is+rollout_kl',
    '--config.correction.is_lower=0.5',
    '--config.correction.rs=token_k1,seq_max_k3',
    '--config.correction.rs_bounds=0.5_2.0,0.01',
    '--config.correction.veto_high=100',
    '--config.actor.agg=token-mean',
    '--config.actor.dro_beta=0.1',
  )
  built = build.losses(cfg)
  assert built.correction == C(
    is_level='token',
    is_upper=2.0,
    is_lower=0.5,
    rs=('token_k1', 'seq_max_k3'),
    rs_bounds=((0.5, 2.0), (None, 0.01)),
    veto_high=100.0,
  )
  assert built.actor == A(agg='token_mean', dro_beta=0.1, **ROLLOUT_KL)


def test_cli_default_and_switches():
  assert build.losses(_parse(f'--config={BASE_FILE}')) == _build()
  off = _parse(f'--config={BASE_FILE}', '--config.correction.enabled=false')
  assert build.losses(off).correction is None
  none = _parse(
    f'--config={BASE_FILE}:decoupled_token_is',
    '--config.correction.is_level=none',
    '--config.actor.agg=None',
  )
  built = build.losses(none)
  assert built.correction == C() and built.actor.agg is None


def test_cli_clip_ratio_c_inf_is_no_dual_clip():
  """None cannot be typed for a float flag; inf is the same loss."""
  cfg = _parse(f'--config={BASE_FILE}', '--config.actor.clip_ratio_c=inf')
  actor = build.losses(cfg).actor
  assert actor.clip_ratio_c == float('inf')
  rng = np.random.default_rng(0)
  lp = rng.normal(-1.0, 0.3, size=(4, 6)).astype(np.float32)
  old = lp + rng.normal(0, 0.3, size=(4, 6)).astype(np.float32)
  adv = rng.normal(size=(4, 6)).astype(np.float32)
  old[1, :3] = lp[1, :3] - 2.0  # ρ = e² > 3 on negative advantages
  adv[1, :3] = -1.0
  adv[0, 0] = 0.0  # -A·inf is NaN here; it must not leak
  mask = np.ones((4, 6), bool)
  mask[2, 4:] = False
  args = dict(advantages=adv, mask=mask, old_logp=old)

  def run(c):
    a = dataclasses.replace(actor, clip_ratio_c=c)
    f = lambda x: obj.actor_objective(a, None, logp=x, **args)  # noqa: E731
    (loss, met), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(lp)
    return float(loss), met, np.asarray(grad)

  l3, m3, _ = run(3.0)
  assert float(m3['actor/pg_clipfrac_lower']) > 0  # the dual clip binds
  li, mi, gi = run(float('inf'))
  ln, _, gn = run(None)
  assert li == ln and li != l3
  np.testing.assert_array_equal(gi, gn)
  assert float(mi['actor/pg_clipfrac_lower']) == 0.0


def test_cli_typo_and_bad_values_fail():
  with pytest.raises(AttributeError, match='Did you mean "is_lower"'):
    _parse(f'--config={BASE_FILE}', '--config.correction.is_lowr=0.5')
  with pytest.raises(flags.IllegalFlagValueError):
    _parse(f'--config={BASE_FILE}', '--config.correction.is_lower=abc')
  with pytest.raises(flags.IllegalFlagValueError, match='unknown preset'):
    _parse(f'--config={BASE_FILE}:nope')
  cfg = _parse(f'--config={BASE_FILE}', '--config.correction.rs_bounds=0.01')
  with pytest.raises(ValueError, match='rs_bounds without rs'):
    build.losses(cfg)


# ------------------------------------------- jaxcorr.config stays generic

CONFIG_DIR = pathlib.Path(base.__file__).resolve().parents[1] / 'jaxcorr/config'
ABOVE_CONFIG = (
  'jaxcorr.losses',
  'jaxcorr.sharding',
  'jaxcorr.train',
  'jaxcorr.data',
  'jaxcorr.rewards',
  'jaxcorr.model',
  'jaxcorr.rollout',
)


def _jaxcorr_imports(path: pathlib.Path) -> list[str]:
  """Every jaxcorr module `path` imports, at any depth (function-level and
  TYPE_CHECKING imports included); `from a import b` counts as `a.b`."""
  found = []
  for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
    if isinstance(node, ast.Import):
      found += [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:  # relative: inside jaxcorr.config
        found += [f'jaxcorr.config.{node.module or ""}']
      elif node.module:
        found += [f'{node.module}.{a.name}' for a in node.names]
  return [m for m in found if m.split('.')[0] == 'jaxcorr']


def test_config_imports_nothing_above_it():
  """jaxcorr/config/ is the generic mechanism: no section, no component."""
  files = sorted(CONFIG_DIR.glob('*.py'))
  assert {f.name for f in files} >= {'__init__.py', 'fields.py', 'convert.py'}
  bad = [
    f'{f.name}: {m}'
    for f in files
    for m in _jaxcorr_imports(f)
    if not m.startswith('jaxcorr.config.')
  ]
  assert not bad, 'jaxcorr/config imports from above it:\n' + '\n'.join(bad)


def test_config_imports_find_a_violation(tmp_path):
  bad = tmp_path / 'bad.py'
  bad.write_text(
    'def f():\n  from jaxcorr.train import run_config\n'
    'from jaxcorr.losses.masked import is_number\n'
    'from jaxcorr.config import fields\n'
  )
  assert _jaxcorr_imports(bad) == [
    'jaxcorr.losses.masked.is_number',
    'jaxcorr.config.fields',
    'jaxcorr.train.run_config',
  ]


def test_importing_config_loads_no_component():
  """The same, at run time: a fresh interpreter that imports the whole
  config package has loaded no jaxcorr module above it."""
  code = (
    'import sys, jaxcorr.config.convert, jaxcorr.config.fields\n'
    'print(sorted(m for m in sys.modules if m.startswith("jaxcorr")))'
  )
  out = subprocess.run(
    [sys.executable, '-c', code],
    cwd=CONFIG_DIR.parents[1],
    capture_output=True,
    text=True,
    check=True,
    timeout=120,
  ).stdout
  loaded = ast.literal_eval(out.strip().splitlines()[-1])
  assert 'jaxcorr.config.convert' in loaded
  assert not [m for m in loaded if m.startswith(ABOVE_CONFIG)], loaded
