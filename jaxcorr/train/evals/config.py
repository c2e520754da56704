"""The `eval` config section: what evaluation runs besides the greedy pass
(docs/evaluation.md). `train.eval_every` and `train.eval_prompts` say when
and on how many prompts.

With the defaults (`eval.samples=0`, `eval.sets=''`) evaluation is the
greedy pass on the data section's held-out prompts, logged as
`eval/accuracy` etc.; `eval.samples=n` adds n sampled replies per prompt at
the `eval.preset` sampling settings, logged as `eval/pass@k`, `eval/maj@k`
and `eval/sampled_accuracy`. Named sets log under `eval/<set>/`.
"""

from __future__ import annotations

import dataclasses
import json
import re

from jaxcorr.config.fields import (
  Invalid,
  boolean,
  fail,
  integer,
  one_of,
  setting,
  validate,
)


@dataclasses.dataclass(frozen=True)
class Preset:
  """Sampling settings of the sampled eval pass (`jaxcorr.sampling`)."""

  temperature: float
  top_k: int  # 0: off
  top_p: float
  min_p: float = 0.0


PRESETS: dict[str, Preset | None] = {
  # The names and values of MaxText RL's evaluate_rl.py.
  'greedy': Preset(temperature=1e-4, top_k=1, top_p=1.0),
  'standard': Preset(temperature=0.7, top_k=50, top_p=0.95),
  'liberal': Preset(temperature=0.85, top_k=2000, top_p=1.0),
  # The training rollout's own settings (rollout.temperature, top_k, ...).
  'rollout': None,
}

# eval.samples' bound: each sample is a decode of every eval prompt, and
# pass@1024 is about the largest k reported; a value past it is a typo
# that would decode for hours, not a measurement.
MAX_SAMPLES = 1024

# A set's name is a metric path segment: eval/<name>/pass@8.
_NAME = re.compile(r'[A-Za-z0-9_.-]+')


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
  seen = set()
  for key, _ in pairs:
    if key in seen:
      raise Invalid(
        'a JSON object whose set names are unique', f'set {key!r} twice'
      )
    seen.add(key)
  return dict(pairs)


def parse_sets(text: str) -> dict[str, dict]:
  """`eval.sets` -> {name: data-field overrides} ('' -> {})."""
  if not text.strip():
    return {}
  allowed = (
    'a JSON object {"name": {data field: value, ..., "prompts": n}, ...}'
  )
  try:
    sets = json.loads(text, object_pairs_hook=_no_duplicates)
  except json.JSONDecodeError as e:
    raise Invalid(allowed, f'not JSON: {e}') from None
  if not isinstance(sets, dict) or not sets:
    raise Invalid(allowed, 'not a non-empty JSON object')
  for name, overrides in sets.items():
    if not _NAME.fullmatch(name):
      raise Invalid(allowed, f'set name {name!r}: use letters, digits, _.-')
    if not isinstance(overrides, dict):
      raise Invalid(allowed, f'set {name!r} is not an object')
  return sets


def _sets_rule(value: object, path: str) -> str:
  if not isinstance(value, str):
    raise Invalid('a string')
  parse_sets(value)
  return value


def parse_ks(text: str) -> tuple[int, ...]:
  """`eval.k` -> the sorted k's ('' -> ())."""
  allowed = "'' (1 and eval.samples) or a comma list of k >= 1, e.g. '1,4,8'"
  try:
    ks = [int(p) for p in text.split(',') if p.strip()]
  except ValueError:
    raise Invalid(allowed, 'not integers') from None
  if any(k < 1 for k in ks):
    raise Invalid(allowed, 'k < 1')
  return tuple(sorted(set(ks)))


def _ks_rule(value: object, path: str) -> str:
  if not isinstance(value, str):
    raise Invalid('a string')
  parse_ks(value)
  return value


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Sampled evaluation and named eval sets (module doc)."""

  sets: str = setting(
    '',
    _sets_rule,
    'Named eval sets, JSON: {"name": {data field overrides, "prompts": n}} '
    '(each set: data.make_eval_source of the data section with the '
    "overrides); '': the data section's held-out prompts, logged as eval/.",
  )
  samples: int = setting(
    0,
    integer(0, MAX_SAMPLES),
    'Sampled replies per eval prompt for pass@k / maj@k (0: greedy only; '
    f'at most {MAX_SAMPLES}).',
  )
  preset: str = setting(
    'standard',
    one_of(*PRESETS),
    'Sampling of the sampled pass: greedy, standard (T=0.7, top_k=50, '
    'top_p=0.95), liberal (T=0.85, top_k=2000, top_p=1) or rollout (the '
    "rollout section's).",
  )
  k: str = setting(
    '',
    _ks_rule,
    "The k's of pass@k and maj@k, a comma list, each <= eval.samples "
    "('': 1 and eval.samples).",
  )
  samples_jsonl: bool = setting(
    True,
    boolean,
    'Write every eval reply to <workdir>/eval_samples/step_<N>.jsonl.',
  )

  def __post_init__(self):
    p = validate(self)
    too_big = [k for k in parse_ks(self.k) if k > self.samples]
    if self.samples and too_big:
      fail(
        f'{p}.k',
        self.k,
        f'k <= eval.samples={self.samples}',
        f'k={too_big[0]} > the {self.samples} samples per prompt',
      )

  @property
  def ks(self) -> tuple[int, ...]:
    """The k's reported (empty without samples)."""
    if not self.samples:
      return ()
    return parse_ks(self.k) or tuple(sorted({1, self.samples}))

  @property
  def named_sets(self) -> dict[str, dict]:
    return parse_sets(self.sets)

  def preset_for(self, rollout: object) -> Preset:
    """The sampling of the sampled pass; `rollout`: the RolloutConfig."""
    preset = PRESETS[self.preset]
    if preset is not None:
      return preset
    return Preset(
      temperature=rollout.temperature,
      top_k=rollout.top_k,
      top_p=rollout.top_p,
      min_p=rollout.min_p,
    )
