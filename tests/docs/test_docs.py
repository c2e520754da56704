"""The documentation tells the truth: its Python snippets run, and every
config field, preset, metric, file, test and section it names exists.

Snippets are the ```python blocks of the README and docs/*.md, in order.
One that uses names it does not define gets them from `SETUPS` (small
arrays, a tiny model, a temporary run directory), keyed by `(file, index)`,
and long ones are shrunk by `SHRINK`, textual replacements that must match
(so a changed snippet fails here instead of silently running unshrunk). A
new snippet runs as it is.
"""

from __future__ import annotations

import ast
import functools
import json
import pathlib
import re

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_SECTION = '\u00a7'  # the section sign, spelled so this file cites nothing
_GUIDE_REF = r'((?:[\w.]+/)*)(\w+)\.md ' + _SECTION + r'(\d+)'
# The top-level pages (the README) and the guides.
DOCS = [*sorted(ROOT.glob('*.md')), *sorted((ROOT / 'docs').glob('*.md'))]


def _rel(path: pathlib.Path) -> str:
  return path.relative_to(ROOT).as_posix()


def _snippets() -> list[tuple[str, int, str]]:
  out = []
  for path in DOCS:
    blocks = re.findall(r'^```python\n(.*?)^```', path.read_text(), re.M | re.S)
    out += [(_rel(path), i, code) for i, code in enumerate(blocks)]
  return out


# -- setups: the names a snippet uses without defining them -----------------


def _algorithms(tmp_path):
  import jax.numpy as jnp

  from jaxcorr.losses import rewards

  b, t = 4, 5
  rng = np.random.default_rng(0)
  mask = jnp.asarray(rng.random((b, t)) > 0.2).at[:, 0].set(True)
  kl_cfg = rewards.KLControlConfig(type='adaptive', target_kl=0.1)
  return dict(
    seq_rewards=jnp.asarray([1.0, 0.0, 1.0, 0.5]),
    mask=mask,
    behaviour_logp=jnp.asarray(-rng.random((b, t)), jnp.float32),
    ref_logp=jnp.asarray(-rng.random((b, t)), jnp.float32),
    kl_state=rewards.init_kl_controller(kl_cfg),
    kl_cfg=kl_cfg,
    group_ids=jnp.asarray([0, 0, 1, 1]),
    values=None,
    batch_size=b,
  )


def _checkpoints(tmp_path):
  run = tmp_path / 'runs' / 'gsm8k'
  run.mkdir(parents=True)
  rows = [{'step': 0}, {'step': 1, 'reward/mean': 0.5}]
  (run / 'metrics.jsonl').write_text(
    ''.join(json.dumps(r) + '\n' for r in rows)
  )
  return {}


def _loader(tmp_path):
  import jax

  from configs import arith_tiny
  from jaxcorr.data import prompts as data

  config = arith_tiny.get_config()
  return dict(
    jax=jax, data=data, config=config, source=data.make_source(config.data)
  )


def _custom_reward(tmp_path):
  from jaxcorr import rewards as reward_fns

  reward_fns.REWARDS.pop('short_answer', None)
  return {}


def _tiny_hf_model(tmp_path):
  """'my-model': a tiny random Qwen2 with a word-level tokenizer."""
  from tokenizers import Tokenizer, models

  from jaxcorr.model import save_hf
  from tests.helpers.model_testing import random_model, tiny_config

  cfg = tiny_config()
  save_hf(random_model(cfg), tmp_path / 'my-model')
  vocab = {f'w{i}': i for i in range(cfg.vocab_size)}
  Tokenizer(models.WordLevel(vocab, unk_token='w0')).save(
    str(tmp_path / 'my-model' / 'tokenizer.json')
  )
  tokens = np.arange(8 * 12, dtype=np.int32).reshape(8, 12) % cfg.vocab_size
  return dict(tokens=tokens)


def _rollout(tmp_path):
  from jaxcorr import sharding
  from tests.helpers.model_testing import random_model, tiny_config

  cfg = tiny_config()
  return dict(
    model=random_model(cfg),
    mesh=sharding.make_mesh(),
    prompts=[[5, 6, 7], [8, 9]],
    eos=1,
    step=0,
    V=cfg.vocab_size,
  )


SETUPS = {
  ('docs/algorithms.md', 0): _algorithms,
  ('docs/checkpoints.md', 0): _checkpoints,
  ('docs/data_and_rewards.md', 0): _loader,
  ('docs/data_and_rewards.md', 1): _custom_reward,
  ('docs/models.md', 0): _tiny_hf_model,
  ('docs/rollout.md', 0): _rollout,
}
SHRINK = {
  ('docs/rollout.md', 0): {
    'max_concurrent_decodes=64': 'max_concurrent_decodes=8',
    'max_prefill_length=512': 'max_prefill_length=8',
    'max_target_length=2048': 'max_target_length=16',
    'max_new_tokens=1024': 'max_new_tokens=4',
  },
}
# Snippets that compile a model (seconds each on a shared 2-core machine).
SLOW = {('docs/models.md', 0), ('docs/rollout.md', 0)}


def _params():
  out = []
  for name, i, code in _snippets():
    marks = [pytest.mark.slow] if (name, i) in SLOW else []
    out.append(pytest.param(name, i, code, id=f'{name}#{i}', marks=marks))
  return out


@pytest.mark.parametrize('name,index,code', _params())
def test_snippet_runs(name, index, code, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  for old, new in SHRINK.get((name, index), {}).items():
    assert old in code, f'{name} snippet {index} no longer has {old!r}'
    code = code.replace(old, new)
  namespace = {'__name__': f'docs_snippet_{index}'}
  namespace.update(SETUPS.get((name, index), lambda _: {})(tmp_path))
  exec(compile(code, f'{name}#python{index}', 'exec'), namespace)


def test_every_setup_names_a_snippet():
  have = {(name, i) for name, i, _ in _snippets()}
  assert set(SETUPS) | set(SHRINK) | SLOW <= have


# -- names the docs mention --------------------------------------------------


def _text() -> dict[str, str]:
  return {_rel(p): p.read_text() for p in DOCS}


@functools.cache
def _config_paths() -> frozenset[str]:
  from configs import base

  def walk(d, prefix):
    for k, v in d.items():
      yield prefix + k
      if isinstance(v, dict):
        yield from walk(v, prefix + k + '.')

  return frozenset(walk(base.get_config().to_dict(), ''))


@functools.cache
def _source_strings() -> tuple[frozenset[str], tuple[re.Pattern, ...]]:
  """Every string literal in jaxcorr/ and configs/, and every f-string as a
  pattern (its fields as wildcards): where metric names come from."""
  literals, patterns = set(), []
  for path in [*ROOT.glob('jaxcorr/**/*.py'), *ROOT.glob('configs/*.py')]:
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Constant) and isinstance(node.value, str):
        literals.add(node.value)
      elif isinstance(node, ast.JoinedStr):
        parts = [
          re.escape(v.value) if isinstance(v, ast.Constant) else r'[\w.\-]+'
          for v in node.values
        ]
        patterns.append(re.compile(''.join(parts)))
  return frozenset(literals), tuple(patterns)


_METRIC = re.compile(
  r'`((?:actor|critic|reward|rollout|rollout_corr|eval|time|perf|sft|'
  r'advantages|returns|response_length|batch|stream|staleness)/[\w/<>*()]+)`'
)


def _metric_exists(name: str) -> bool:
  literals, patterns = _source_strings()
  prefix, _, rest = name.partition('/')
  if f'{prefix}/' in literals and _key_exists(rest, literals, patterns):
    return True  # 'rollout_corr/' + key
  return _key_exists(name, literals, patterns)


def _key_exists(name: str, literals, patterns) -> bool:
  variants = {name}
  if '(' in name:  # `pg_clipfrac(_lower)`: with and without the part
    variants = {
      re.sub(r'\((\w+)\)', r'\1', name),
      re.sub(r'\(\w+\)', '', name),
    }
  for v in variants:
    if '<' in v or '*' in v:
      wanted = re.compile(
        re.sub(
          r'<\w+>|\\\*', r'[\\w.\\-]+', re.escape(v).replace(r'\<', '<')
        ).replace(r'\>', '')
      )
      concrete = re.sub(r'<\w+>|\*', 'x', v)
      if not any(wanted.fullmatch(s) for s in literals) and not any(
        p.fullmatch(concrete) for p in patterns
      ):
        return False
    elif v not in literals and not any(p.fullmatch(v) for p in patterns):
      return False
  return True


def test_metrics_named_in_the_docs_are_logged():
  missing = sorted(
    {
      (doc, m)
      for doc, text in _text().items()
      for m in _METRIC.findall(text)
      if not _metric_exists(m)
    }
  )
  assert not missing


# The docs' example of a typo that the locked config rejects.
TYPOS_ON_PURPOSE = {'train.num_step'}
_EXTENSIONS = {
  'py',
  'md',
  'json',
  'jsonl',
  'ipynb',
  'sh',
  'txt',
  'parquet',
  'safetensors',
  'gguf',
}
_CONFIG_REF = re.compile(r'(?<![\w.])config\.([a-z_]+(?:\.[a-z_]+)+)')
_FIELD_REF = re.compile(r'`([a-z_]+)\.([a-z_]+(?:\.[a-z_]+)*)(?:=[^`]*)?`')


def _is_module_attribute(section: str, name: str) -> bool:
  """`data.make_source`, `checkpoint.abstract_like`: a module's name, not
  a config field."""
  import importlib

  for module in (f'jaxcorr.train.{section}', f'jaxcorr.{section}'):
    try:
      mod = importlib.import_module(module)
    except ImportError:
      continue
    if hasattr(mod, name.split('.')[0]):
      return True
  return False


def _own_names(text: str) -> str:
  """`text` without the sections that map other frameworks' config names
  (`## Mapping from verl ...`, `### From SkyRL ...`): those are theirs."""
  parts = re.split(r'^(#+ .*)$', text, flags=re.M)
  keep, skip = [parts[0]], False
  for i in range(1, len(parts), 2):
    heading, body = parts[i], parts[i + 1]
    level = len(heading) - len(heading.lstrip('#'))
    if re.search(r'Mapping|Migrating|^#+ From ', heading):
      skip = level
    elif skip and level <= skip:
      skip = False
    if not skip:
      keep += [heading, body]
  return ''.join(keep)


def test_config_fields_named_in_the_docs_exist():
  paths = _config_paths()
  sections = {p for p in paths if '.' not in p}
  missing = set()
  for doc, text in _text().items():
    text = _own_names(text)
    for ref in _CONFIG_REF.findall(text):
      if ref not in paths and ref not in TYPOS_ON_PURPOSE:
        missing.add((doc, ref))
    for section, rest in _FIELD_REF.findall(text):
      ref = f'{section}.{rest}'
      if section not in sections or ref in paths or rest in _EXTENSIONS:
        continue
      if not _is_module_attribute(section, rest):
        missing.add((doc, ref))
  assert not sorted(missing)


def test_presets_named_in_the_docs_exist():
  from configs import opd, presets

  known = set(presets.PRESETS) | set(opd.OPD_PRESETS) | {'pulse', 'OFF', 'off'}
  refs = set()
  for doc, text in _text().items():
    # A task config's config string (not `configs/x.py:function()`).
    for spec in re.findall(r'configs/\w+\.py:([\w+]+)(?![\w(])', text):
      refs |= {(doc, p) for p in spec.split('+') if p}
    for name in re.findall(r'preset `(\w+)`|`(\w+)` preset', text):
      refs |= {(doc, n) for n in name if n}
  missing = sorted((d, p) for d, p in refs if p not in known)
  assert refs and not missing


_FILE = re.compile(
  r'(?<![\w/.])((?:tests|docs|configs|jaxcorr|bench|notebooks)/'
  r'[\w./-]*\w\.(?:py|md|json|ipynb|sh))(?:::(\w+))?'
)


# `test_`-names in the docs that are not tests: verl's `trainer.test_freq`.
NOT_TESTS = {'test_freq'}


@functools.cache
def _test_names() -> frozenset[str]:
  names = set()
  for path in ROOT.glob('tests/**/*.py'):
    names |= set(re.findall(r'^def (test_\w+)', path.read_text(), re.M))
  return frozenset(names)


def test_files_and_tests_named_in_the_docs_exist():
  missing = set()
  for doc, text in _text().items():
    for path, test in _FILE.findall(text):
      if not (ROOT / path).exists():
        missing.add((doc, path))
      elif test and not re.search(
        rf'^def {test}\b', (ROOT / path).read_text(), re.M
      ):
        missing.add((doc, f'{path}::{test}'))
    for test in re.findall(r'`(?:::)?(test_\w+)`', text):
      if test not in _test_names() and test not in NOT_TESTS:
        missing.add((doc, test))
  assert not sorted(missing)


def test_numbered_section_references_resolve():
  """A numbered reference to a user guide of docs/ must point at one of
  its `## N.` headings."""
  bad = []
  for doc, text in _text().items():
    # docs/math/ pages number their headings with the section sign and are
    # checked by tests/docs/test_doc_references.py; the user guides use 'N.'.
    for prefix, target, number in re.findall(_GUIDE_REF, text):
      path = ROOT / 'docs' / f'{target}.md'
      if 'math/' in prefix or not path.exists():
        continue
      if not re.search(rf'^#+ {number}\.', path.read_text(), re.M):
        bad.append((doc, f'{target}.md {_SECTION}{number}'))
  assert not bad


def test_notebook_outputs_are_ignored():
  ignored = (ROOT / 'notebooks' / '.gitignore').read_text().split()
  for nb in (ROOT / 'notebooks').glob('*.ipynb'):
    for out in re.findall(r"abspath\(\\?'(\w+)\\?'\)", nb.read_text()):
      assert f'{out}/' in ignored, (nb.name, out)
